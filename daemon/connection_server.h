// The HTTP server both listeners run: httplib's request handling under flashd's own connection
// loop.
//
// httplib 0.11 serves a connection by making a new read buffer for every request, so the bytes of
// a pipelined second request, already read with the first, are lost (only the first is
// answered); it leaves Nagle's algorithm on for accepted TCP sockets, so a keep-alive client
// waits for a delayed ACK (about 40 ms) on every request; and it applies a Range header to any
// response, POSTs included. This server keeps one buffered stream per connection, so pipelined
// requests are answered in order; sets TCP_NODELAY on each accepted TCP socket; honours Range on
// GET only; and, on the Unix socket, reads the peer's credentials (SO_PEERCRED) before serving
// the connection, so every handler sees them through api::CurrentPeer() (a connection's
// requests are handled on the thread that read them). Requests themselves go through httplib's
// own process_request, so parsing, limits and error answers stay httplib's.
#pragma once

#include <httplib.h>

#include <memory>

namespace flashd::daemon {

enum class Listener { kTcp, kUnix };

std::unique_ptr<httplib::Server> MakeConnectionServer(Listener listener);

// Makes `server` (from MakeConnectionServer) serve `fd`, a socket already bound and listening
// (inherited from systemd's socket activation), instead of binding one itself; then
// listen_after_bind() accepts on it. The server closes it when it stops.
void AdoptListeningSocket(httplib::Server* server, int fd);

}  // namespace flashd::daemon
