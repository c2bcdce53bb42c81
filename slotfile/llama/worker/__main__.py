import sys

from slotfile.llama.worker.program import main

sys.exit(main())
