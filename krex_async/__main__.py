import sys

from krex_async.cli import main

sys.exit(main())
