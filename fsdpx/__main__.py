import atexit
import gc

from fsdpx.cli import main

# When the process ends its objects need no last garbage collection: freezing them (the last
# atexit handler to run, as the first registered) skips the interpreter's final pass over
# torch's and scipy's objects, about 0.6 s of CPU in each process (the launcher and every
# worker; benchmarks/cli_startup.py). Threads are still joined, the other atexit handlers run
# and files are flushed and closed as before; run inside another program (runpy), it only
# happens when that program exits.
atexit.register(gc.freeze)
main()
