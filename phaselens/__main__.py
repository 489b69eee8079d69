import sys

from phaselens.cli import main

sys.exit(main())
