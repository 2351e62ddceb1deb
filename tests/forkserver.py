"""A process that imports plait (and torch) once, then forks one child per `plait` process the
tests start: each child is a new process with its own environment, working folder, output files
and arguments, which runs `plait.cli.main` as `python -m plait` would, minus ~4 s of imports
(and runs a sitecustomize.py that its PYTHONPATH adds, as Python's start-up would: after the
imports, so one that patches plait must patch modules already imported).
(PyTorch's DataLoader forks its workers after importing torch the same way.)

Protocol, one JSON line each way: the tests send {"argv", "env", "stdout", "stderr"} and get
{"pid"}; when a child ends, {"exited": pid, "code"} (the signal's number negated, as Popen says).
Single-threaded on purpose: a fork copies only the calling thread, so no other thread may hold
a lock the child needs.
"""

import json
import os
import runpy
import select
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's plait, whichever one an editable install points at

import plait.cli  # noqa: E402
import plait.doctor  # noqa: E402,F401 (imported for the children: it imports plait.train)
import plait.parallel.pipeline  # noqa: E402,F401 (and the pipeline rows' schedules, which plait.train imports late)
import torch._inductor.compile_fx  # noqa: E402,F401 (torch.compile's compiler, ~1.2 s imported at a run's first graph)
from plait.arguments import parse_args  # noqa: E402

parse_args([])  # (tyro's first parse builds what it caches of JobConfig's fields, ~0.15 s: once here, not per child)


def child(request: dict) -> None:
    """In the forked process: become the requested `plait` process, then exit with its code."""
    os.setsid()  # its own process group, as a fresh process under the test's launcher
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(ROOT)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # and lets go of the server's request pipe
    os.close(devnull)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # new objects: the server's may hold locks
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = ["plait", *request["argv"]]
    for folder in request["env"].get("PYTHONPATH", "").split(os.pathsep):  # as Python's start-up would
        if folder and folder not in sys.path and os.path.isfile(os.path.join(folder, "sitecustomize.py")):
            runpy.run_path(os.path.join(folder, "sitecustomize.py"), run_name="sitecustomize")
            break
    try:
        code = plait.cli.main(request["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def reply(message: dict) -> None:
    sys.__stdout__.write(json.dumps(message) + "\n")
    sys.__stdout__.flush()


def serve() -> None:
    requests = sys.stdin.buffer
    pending = b""
    while True:
        while True:  # report every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if not select.select([requests], [], [], 0.02)[0]:
            continue
        data = os.read(requests.fileno(), 1 << 16)
        if not data:
            return  # the tests are done
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                child(json.loads(line))
            reply({"pid": pid})


if __name__ == "__main__":
    serve()
