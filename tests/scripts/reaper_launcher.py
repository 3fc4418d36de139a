"""A launcher for tests/test_reaper.py: inside ``hookloop.as_launcher(reap=...)`` it starts
a daemon (a double-forked process in a session of its own, importing no hookloop) and
prints its pid; then it waits to be killed, or with ``--leave`` leaves the block, prints
``left`` and exits. ``--no-reap``: without the reaper."""

import subprocess
import sys
import time

import hookloop

DAEMON = (
    "import os, sys, time\n"
    "pid = os.fork()\n"
    "if pid:\n"
    "    print(pid, flush=True)\n"
    "    os._exit(0)\n"
    "os.setsid()\n"
    "sys.stdout.close()\n"
    "time.sleep(120)\n"
)

with hookloop.as_launcher(reap="--no-reap" not in sys.argv):
    starter = subprocess.Popen([sys.executable, "-c", DAEMON], stdout=subprocess.PIPE, text=True)
    print(starter.stdout.readline().strip(), flush=True)
    starter.wait()
    if "--leave" not in sys.argv:
        time.sleep(120)
print("left", flush=True)
