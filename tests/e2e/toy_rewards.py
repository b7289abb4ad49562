"""A user reward for the e2e tests, passed as rollout.reward=tests.e2e.toy_rewards:digit_fraction.

A randomly initialised tiny model almost never hits an exact-match answer, so its rewards would all
be 0 and nothing would train; the fraction of digit characters varies from the first step."""


def digit_fraction(response_text: str, answer: str, *, finished: bool, prompt: str = "", meta=None) -> float:
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)


def flaky_digit_fraction(response_text: str, answer: str, *, finished: bool, prompt: str = "", meta=None) -> float:
    """digit_fraction, but raises for about 1 response in 12 (chosen by a stable hash of the text, so
    a run of ~100 samples sees at least one with probability > 0.999): the run must count those
    samples as failed and go on. (Raising for responses starting with 'z' was too rare: a few runs
    in a hundred saw none.)"""
    import zlib

    if zlib.crc32(response_text.encode()) % 12 == 0:
        raise ValueError("toy reward refuses this response (crc32 % 12 == 0)")
    return digit_fraction(response_text, answer, finished=finished)
