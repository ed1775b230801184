// The Unix socket's HTTP server, which knows who is on the other end of each connection: the
// peer's credentials (SO_PEERCRED) are read from the accepted socket before its requests are
// handled, and every handler for that connection sees them through api::CurrentPeer() (the
// connection's requests are handled on the thread that read them).
//
// httplib offers no hook between accepting a connection and serving it, so this server overrides
// its per-connection entry point and then runs httplib's own implementation of it, found by its
// exported symbol in the httplib library. When that symbol is missing (another httplib build),
// MakeUnixServer returns a plain server and socket requests carry no peer: a warning says so.
#pragma once

#include <httplib.h>

#include <memory>

namespace flashd::daemon {

std::unique_ptr<httplib::Server> MakeUnixServer();

}  // namespace flashd::daemon
