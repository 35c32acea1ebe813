"""`python -m pytgi_bench.compare`: the side-by-side benchmark (run.py), as `make bench` runs it."""

import sys

from pytgi_bench.compare.run import main

sys.exit(main())
