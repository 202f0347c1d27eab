import sys

from benchmarks.gpu_check.harness import apply_module_blocks, main

apply_module_blocks()
sys.exit(main())
