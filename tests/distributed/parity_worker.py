"""Run by test_check_parity.py (plain python or torchrun): several tools/check_parity.py checks in one
launch (`--cases FILE`, see grouped_cases.py), each printed as the tool prints it, plus its case name."""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

from megatron_flash.trainer.distributed import destroy_distributed  # noqa: E402
from tests.distributed.grouped_cases import read_cases  # noqa: E402
from tools.check_parity import arg_parser, build_policy, compare  # noqa: E402


def main() -> None:
    for name, argv in read_cases(sys.argv[1:]).items():
        args = arg_parser().parse_args(argv)
        result = compare(build_policy(args), args)
        if result is not None:
            print(json.dumps({"case": name, **result}), flush=True)
        gc.collect()  # the previous case's model
    destroy_distributed()


if __name__ == "__main__":
    main()
