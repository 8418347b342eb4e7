"""A Python that has already imported what train.py and the latentwire commands import, forking one
child per command (tests/test_bad_inputs.py). A bad input fails in its checks, seconds before any
work, and most of those seconds are imports (torch, transformers, FSDP): the child of an interpreter
that made them once starts where the checks begin. Each child is still its own process, with its
own working directory, output files, exit code and alarm; the environment is the server's, so the
server is started with the one its commands need (imports read it).

Requests on stdin, one JSON object a line: {"target": "train.py" or a module ("latentwire.plan"),
"args": [...], "cwd": DIR, "stdout": FILE, "stderr": FILE, "timeout": SECONDS}. The reply is a
line with the child's exit code (negative: the signal that ended it, SIGALRM past its timeout).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import train  # noqa: E402,F401  torch, transformers, the package: what every command imports


def child(request: dict) -> int:
    signal.alarm(request["timeout"])
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    target = request["target"]
    try:
        if target.endswith(".py"):
            sys.argv = [str(REPO / target), *request["args"]]
            runpy.run_path(sys.argv[0], run_name="__main__")
        else:
            # `python -m` runs a module no one has imported yet: a loaded copy would make runpy warn
            sys.modules.pop(target, None)
            sys.argv = [target, *request["args"]]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:  # what the interpreter does with it at exit
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = child(request)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
