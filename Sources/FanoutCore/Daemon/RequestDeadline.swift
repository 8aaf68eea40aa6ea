// SPDX-License-Identifier: Apache-2.0
import NIOCore
import NIOHTTPTypes

/// Closes a connection whose request has not arrived whole (head to end of body) within `limit`
/// of its head. Hummingbird's idle timer restarts on every part read, so without this a client
/// that drips a body, one byte at a time, would hold its connection for as long as it likes.
final class RequestDeadlineHandler: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPRequestPart
    typealias InboundOut = HTTPRequestPart

    private let limit: TimeAmount
    private var deadline: Scheduled<Void>?

    init(limit: TimeAmount) {
        self.limit = limit
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        switch unwrapInboundIn(data) {
        case .head:
            deadline?.cancel()
            deadline = context.eventLoop.assumeIsolated().scheduleTask(in: limit) { [weak self] in
                self?.deadline = nil
                context.close(promise: nil)
            }
        case .body:
            break
        case .end:
            deadline?.cancel()
            deadline = nil
        }
        context.fireChannelRead(data)
    }

    func channelInactive(context: ChannelHandlerContext) {
        deadline?.cancel()
        deadline = nil
        context.fireChannelInactive()
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        deadline?.cancel()
        deadline = nil
    }
}
