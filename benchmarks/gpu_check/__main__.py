import sys

from benchmarks.gpu_check.harness import main

sys.exit(main())
