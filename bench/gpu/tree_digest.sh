#!/bin/bash
# One digest of the krex_async sources, so that an accelerator run's log names the code it ran even
# where the copy's .git is older than its files (batch.sh prints it; compare at a checkout).
cd "$(dirname "$0")/../.." && find krex_async -name '*.py' -type f | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12
