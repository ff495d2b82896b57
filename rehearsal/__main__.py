import sys

from rehearsal.run import main

sys.exit(main())
