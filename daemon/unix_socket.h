// Helpers for the Unix-socket listener's file: claiming the path and setting its permissions.
#pragma once

#include <string>

#include "config/status.h"

namespace flashd::daemon {

// Makes `path` free for a new listener. A socket file nobody answers on is stale and removed; a
// socket a live daemon answers on is left alone and reported as FailedPrecondition; anything that
// is not a socket is never removed.
Status ClaimSocketPath(const std::string& path);

// Sets the socket file's mode and, when `group` is not empty, its group.
Status SetSocketPermissions(const std::string& path, unsigned mode, const std::string& group);

}  // namespace flashd::daemon
