"""The executable torchrun runs as a worker's Python when PYTHON_EXEC names it (tests/programs/zygote.py writes it, with
its interpreter on the first line): it asks the zygote beside it to fork the worker, forwards the signals it gets to
that child, and exits as the child did. If the zygote answers "cold" (or is not there), it becomes the real
interpreter with the same argv and environment. It imports nothing but the standard library: it starts in
milliseconds.
"""
import json
import os
import signal
import socket
import sys

FOLDER = os.path.dirname(os.path.abspath(__file__))
FORWARDED = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM]


def cold(python):
    os.execv(python, [python, *sys.argv[1:]])


def lines(conn):
    """The zygote's answers, one JSON object a line, until it closes the connection."""
    buffer = b""
    while True:
        try:
            chunk = conn.recv(4096)
        except InterruptedError:
            continue
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield json.loads(line)


def main():
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.path.join(FOLDER, "socket"))
    except OSError:
        cold(sys.executable)
    request = dict(argv=sys.argv[1:], env=dict(os.environ), cwd=os.getcwd())
    child, pending = [], []

    def forward(sig, _):  # a signal that comes before the child's pid waits for it
        os.kill(child[0], sig) if child else pending.append(sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    for message in lines(conn):
        if "cold" in message:
            conn.close()
            cold(message["python"])
        if "pid" in message:
            child.append(message["pid"])
            for sig in pending:
                os.kill(child[0], sig)
        if "status" in message:
            status = message["status"]
            if os.WIFSIGNALED(status):  # died of a signal: so does this process, as the worker's own would
                sig = os.WTERMSIG(status)
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
            os._exit(os.waitstatus_to_exitcode(status))
    print("zygote_exec: the zygote ended before the worker did", file=sys.stderr)
    os._exit(1)


main()
