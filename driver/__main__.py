import sys

from driver.cli import main

sys.exit(main())
