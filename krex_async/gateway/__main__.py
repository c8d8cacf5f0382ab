"""`python -m krex_async.gateway ...`: the gateway before it is wired into `krex`."""

import argparse
import sys

from krex_async.gateway import add_parser, main

ap = argparse.ArgumentParser(prog="krex")
add_parser(ap.add_subparsers(dest="verb", required=True))
sys.exit(main(ap.parse_args(["gateway", *sys.argv[1:]])))
