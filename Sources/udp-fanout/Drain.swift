// SPDX-License-Identifier: Apache-2.0
import ArgumentParser
import FanoutCore
import ReusePortLB
import SystemCalls
import CSystemShim

#if canImport(Glibc)
import Glibc
#endif

/// `udp-fanout drain`: take a node out of its fleet without losing what is in flight.
struct Drain: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Drain a running udp-fanout: withdraw its announced addresses, serve what still arrives for drain_secs, then stop it.",
        discussion: """
            Finds the daemon through its HTTP endpoint (GET /status gives its pid; -c reads \
            metrics.bind of its configuration, or --endpoint), then sends it SIGUSR2, which is \
            what `systemctl kill -s SIGUSR2 udp-fanout` does too. The daemon removes the routes \
            of its announce addresses (the routing daemon withdraws them from its peers), keeps \
            every listener serving for announce.drain_secs (datagrams routers already sent, \
            replies to two-way clients), then stops and exits 0: under systemd the unit stays \
            stopped (docs/fleet.md). Without --no-wait the command waits until the daemon is \
            gone. Exit status: 0 drained (or asked, with --no-wait), 1 no daemon answered or it \
            did not stop in time, 2 the file cannot be read or has no endpoint, 4 not allowed \
            to signal it (run as root or the daemon's user).
            """)

    @OptionGroup var daemon: DaemonEndpoint

    @Flag(help: "Return once the daemon was asked, without waiting for it to stop.")
    var noWait = false

    func run() async throws {
        let url = try daemon.url("drain")
        let report: StatusReport
        do {
            report = try await StatusClient.fetch(url)
        } catch {
            printError("udp-fanout drain: \(error)")
            throw ExitCode(1)
        }
        // The pid is the daemon's in its own pid namespace: here it may be another process. A
        // pidfd pins the process checked, so the signal cannot reach a pid reused in between.
        let pidfd = shim_pidfd_open(report.pid)
        let openError = pidfd >= 0 ? 0 : errno
        guard pidfd >= 0 || openError == ESRCH else {
            printError("udp-fanout drain: pidfd_open(\(report.pid)): \(String(cString: strerror(openError))) (a kernel before 5.3, or a seccomp profile that refuses it): use `systemctl kill -s SIGUSR2 udp-fanout` or `kill -USR2 \(report.pid)`")
            throw ExitCode(1)
        }
        defer { if pidfd >= 0 { close(pidfd) } }
        guard pidfd >= 0, let started = ProcessMetrics.startTime(pid: report.pid), abs(started - report.startedAt) < 1 else {
            printError("udp-fanout drain: pid \(report.pid) here is not the daemon at \(url) (it runs in another pid namespace, a container, or it has just exited): run the command there, or `systemctl kill -s SIGUSR2 udp-fanout`")
            throw ExitCode(1)
        }
        if report.announce?.draining == true {
            print("udp-fanout drain: pid \(report.pid) is already draining")
        } else {
            guard shim_pidfd_send_signal(pidfd, SIGUSR2) == 0 else {
                let code = errno
                printError("udp-fanout drain: cannot signal pid \(report.pid) (the daemon at \(url)): \(String(cString: strerror(code)))"
                    + (code == EPERM ? ": run as root or as the daemon's user" : ""))
                throw ExitCode(code == EPERM ? 4 : 1)
            }
            let addresses = report.announce?.addresses.map(\.address) ?? []
            print(addresses.isEmpty
                  ? "udp-fanout drain: pid \(report.pid) has no announce section: nothing to withdraw, it stops now"
                  : "udp-fanout drain: pid \(report.pid) withdraws \(addresses.joined(separator: ", ")) and serves for up to \(report.announce?.drainSecs ?? 0) s, then stops")
        }
        guard !noWait else { return }
        let drainSecs = report.announce?.drainSecs ?? 0
        // The pidfd turns readable when the process exits.
        var entry = pollfd(fd: pidfd, events: Int16(POLLIN), revents: 0)
        let deadline = ContinuousClock.now + .seconds(drainSecs + 30)
        while ContinuousClock.now < deadline {
            if (try? Syscall.poll(&entry, 1, 100, call: "poll pidfd")).map({ $0 > 0 }) == true {
                print("udp-fanout drain: pid \(report.pid) stopped")
                return
            }
            try await Task.sleep(for: .milliseconds(1))
        }
        printError("udp-fanout drain: pid \(report.pid) is still running \(drainSecs + 30) s later: see its log")
        throw ExitCode(1)
    }
}
