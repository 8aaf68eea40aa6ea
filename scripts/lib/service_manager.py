# SPDX-License-Identifier: Apache-2.0
"""A service manager for one Type=notify service, speaking systemd's protocol where no systemd runs
(make deb-check's chroot): $NOTIFY_SOCKET messages (logged one per line, newlines as spaces),
the descriptor store (FDSTORE=1 with FDNAME=, FDSTOREREMOVE=1), and starts that hand the store
back (LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID) as systemd 252 does for a unit with
FileDescriptorStoreMax=.

    service_manager.py NOTIFY_PATH LOG PIDFILE -- COMMAND...

COMMAND runs with NOTIFY_SOCKET=NOTIFY_PATH in its environment; an argument "@ENV@" in it is
replaced by the LISTEN_* assignments (for a command that clears its environment, env -i), and the
command must export LISTEN_PID=$$ itself before its last exec (a shell's `exec` keeps the pid).
SIGUSR1: a restart (SIGTERM, wait, start again with the store). SIGTERM: a stop (SIGTERM, wait,
close the store), then exit. The child's exits are logged as "exited STATUS"; each start's pid is
written to PIDFILE and logged as "started PID".
"""
import array
import fcntl
import os
import select
import signal
import socket
import sys
import time


class Child:
    """A started service: its pid, and its exit status once reaped (as subprocess.Popen's)."""

    def __init__(self, pid):
        self.pid = pid
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self):
        while self.poll() is None:
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, number):
        if self.returncode is None:
            os.kill(self.pid, number)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def main():
    notify_path, log_path, pidfile = sys.argv[1:4]
    assert sys.argv[4] == "--"
    command = sys.argv[5:]
    directory, name = os.path.split(notify_path)
    os.chdir(directory)  # a short relative path: an absolute one may exceed sun_path
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(name)
    os.chmod(name, 0o777)
    log = open(log_path, "a", buffering=1)
    store = []  # (name, fd), in arrival order
    child = None
    requests = []
    signal.signal(signal.SIGUSR1, lambda *_: requests.append("restart"))
    signal.signal(signal.SIGTERM, lambda *_: requests.append("stop"))

    def start():
        nonlocal child
        fds = [fd for _, fd in store]
        assignments = []
        if fds:
            assignments = ["LISTEN_FDS=%d" % len(fds), "LISTEN_FDNAMES=" + ":".join(n for n, _ in store)]
        argv = []
        for word in command:
            argv += assignments if word == "@ENV@" else [word]
        environment = dict(os.environ, NOTIFY_SOCKET=notify_path)
        if "@ENV@" not in command:
            environment.update(a.split("=", 1) for a in assignments)

        # The store's descriptors at 3, 4, ... in the child: close-on-exec copies above that range
        # first (no dup2 overwrites one still to be placed), then posix_spawn's dup2 actions.
        # Every other descriptor of this process is close-on-exec (the received ones are made
        # so), so the child gets only these; an exec failure (E2BIG: LISTEN_FDNAMES over
        # 128 KiB) comes back here as OSError, and the start fails as systemd's would.
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3 + len(fds)) for fd in fds]
        try:
            pid = os.posix_spawnp(argv[0], argv, environment, setsigmask=(),
                                  file_actions=[(os.POSIX_SPAWN_DUP2, fd, 3 + index) for index, fd in enumerate(moved)])
        except OSError as error:
            log.write("start failed: %s\n" % error)
            child = None
            return
        finally:
            for fd in moved:
                os.close(fd)
        child = Child(pid)
        with open(pidfile, "w") as out:
            out.write("%d\n" % child.pid)
        log.write("started %d with %d descriptor(s)\n" % (child.pid, len(fds)))

    def terminate():
        nonlocal child
        if child is None:
            return
        child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20  # the unit's TimeoutStopSec=
        while child.poll() is None:
            receive(0.05)
            if time.monotonic() > deadline:
                log.write("stop timed out after 20 s: SIGKILL\n")
                child.kill()
                child.wait()
        receive(0)
        log.write("exited %d\n" % child.returncode)
        child = None

    def receive(timeout):
        while True:
            ready, _, _ = select.select([sock], [], [], timeout)
            if not ready:
                return
            timeout = 0
            message, ancillary, flags, _ = sock.recvmsg(4096, socket.CMSG_SPACE(253 * 4))
            if flags & socket.MSG_CTRUNC:
                log.write("a notification's descriptors were cut (MSG_CTRUNC)\n")
            fds = array.array("i")
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
            for fd in fds:
                os.set_inheritable(fd, False)
            fields = dict(line.split("=", 1) for line in message.decode(errors="replace").split("\n") if "=" in line)
            if fields.get("FDSTORE") == "1":
                store.extend((fields.get("FDNAME", "stored"), fd) for fd in fds)
            else:
                for fd in fds:
                    os.close(fd)
            if fields.get("FDSTOREREMOVE") == "1":
                for stored_name, fd in [entry for entry in store if entry[0] == fields.get("FDNAME")]:
                    os.close(fd)
                store[:] = [entry for entry in store if entry[0] != fields.get("FDNAME")]
            log.write(message.decode(errors="replace").replace("\n", " ") + "\n")

    log.write("listening\n")
    start()
    while True:
        receive(0.05)
        if child is not None and child.poll() is not None:
            log.write("exited %d\n" % child.returncode)
            child = None
        while requests:
            request = requests.pop(0)
            if request == "restart":
                terminate()
                log.write("restarting with %d stored descriptor(s)\n" % len(store))
                start()
            else:
                terminate()
                for _, fd in store:
                    os.close(fd)
                log.write("stopped: the store is closed\n")
                return


if __name__ == "__main__":
    main()
