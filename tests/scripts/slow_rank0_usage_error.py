"""A launched script whose rank 0 reaches argument parsing late (as a slow import would make
it): every rank makes the same usage mistake, and rank 0 must still be the one that reports it."""

import argparse
import os
import time

from hf_zero.launch_errors import parse_or_exit

if os.environ.get("RANK") == "0":
    time.sleep(3)
parser = argparse.ArgumentParser()
parser.add_argument("--zero_stage", type=int)
parse_or_exit(parser.parse_args)
