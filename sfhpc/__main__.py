import sys

from sfhpc.cli import main

sys.exit(main())
