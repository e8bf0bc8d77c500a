"""``python -m kernels [--all | --level NAME]``: build the CPU kernels (see `kernels.cpu_extension.main`)."""

import sys

from kernels.cpu_extension import main

sys.exit(main())
