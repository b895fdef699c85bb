import sys

from moerun.cli import main

sys.exit(main())
