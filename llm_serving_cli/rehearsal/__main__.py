import sys

from llm_serving_cli.rehearsal.run import main

sys.exit(main())
