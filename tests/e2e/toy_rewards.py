"""A user reward for the e2e tests, passed as rollout.reward=tests.e2e.toy_rewards:digit_fraction.

A randomly initialised tiny model almost never hits an exact-match answer, so its rewards would all
be 0 and nothing would train; the fraction of digit characters varies from the first step."""


def digit_fraction(response_text: str, answer: str, *, finished: bool, prompt: str = "", meta=None) -> float:
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)


def flaky_digit_fraction(response_text: str, answer: str, *, finished: bool, prompt: str = "", meta=None) -> float:
    """digit_fraction, but raises for responses starting with 'z' (a few percent of them): the run
    must count those samples as failed and go on."""
    if response_text.startswith("z"):
        raise ValueError("toy reward refuses responses starting with 'z'")
    return digit_fraction(response_text, answer, finished=finished)
