"""Run a command as a child subreaper and print its wall time and the CPU of its whole process tree.

A forkserver that pytest leaves running at exit is reparented here and reaped, so the CPU of the
processes it forked counts too (``/usr/bin/time`` misses them).

    python reap.py LABEL COMMAND...
"""

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36

ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
t = time.perf_counter()
rc = subprocess.call(sys.argv[2:])
wall = time.perf_counter() - t
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
r = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = r.ru_utime + r.ru_stime
print(
    f"{sys.argv[1]}: rc {rc} wall {wall:.1f} s cpu {cpu:.1f} s (user {r.ru_utime:.1f} sys {r.ru_stime:.1f})", flush=True
)
