// flashd: the daemon binary and its subcommands.
#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "config/config.h"
#include "daemon/daemon.h"
#include "daemon/eval_command.h"
#include "daemon/model_commands.h"
#include "daemon/version.h"

namespace flashd {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;  // Bad command line or bad configuration.

constexpr const char* kDefaultConfigPath = "/etc/flashd/flashd.yaml";

void PrintMainHelp() {
  std::printf(
      "flashd %s: serves DeepSeek-V4.1-Flash to coding agents over HTTP and a Unix socket,\n"
      "keeping compressed KV prefixes on disk so long contexts resume without prefill.\n\n"
      "Usage: flashd <command> [options]\n\n"
      "Commands:\n"
      "  serve       run the daemon in the foreground\n"
      "  mkmodel     write a tiny checkpoint in the released format (random weights)\n"
      "  model-info  parameters, KV bytes per token and state of a model or config.json\n"
      "  plan        where a model's parts go on a machine's GPUs and memory, and the KV that "
      "fits\n"
      "  eval        token ids -> logits (and layer streams) of a model, as .npy/safetensors\n"
      "  tokenize    text on stdin -> token ids (JSON array)\n"
      "  detokenize  token ids (JSON array) on stdin -> text\n"
      "  version     print the version and build\n"
      "  help        print this help (also: flashd <command> --help)\n",
      kVersion);
}

void PrintServeHelp() {
  std::printf(
      "Usage: flashd serve [--config FILE]\n\n"
      "Runs the daemon in the foreground until SIGTERM or SIGINT.\n\n"
      "Options:\n"
      "  --config FILE   configuration file (default: $FLASHD_CONFIG, else %s if it\n"
      "                  exists, else built-in defaults)\n"
      "  --help          print this help\n\n"
      "Environment overrides, applied after the file:\n"
      "  FLASHD_LISTEN     TCP address host:port (\"\" disables TCP)\n"
      "  FLASHD_SOCKET     Unix socket path (\"\" disables the socket)\n"
      "  FLASHD_STATE_DIR  state directory\n"
      "  FLASHD_MODEL_DIR  model directory (\"\" serves the embedded default model)\n"
      "  FLASHD_LOG_LEVEL  trace, debug, info, warn, error or off\n"
      "  FLASHD_BACKEND    engine.backend: auto, cpu, cuda, hip or hipcpu\n\n"
      "Prints \"flashd ready: ...\" on stdout once every listener accepts requests.\n"
      "Exit codes: 0 clean shutdown, 1 runtime failure, 2 bad configuration or usage.\n",
      kDefaultConfigPath);
}

void PrintVersionHelp() { std::printf("Usage: flashd version\n\nPrints the version and build.\n"); }

bool WantsHelp(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

int Version(const std::vector<std::string>& args) {
  if (WantsHelp(args)) {
    PrintVersionHelp();
    return kExitOk;
  }
  if (!args.empty()) {
    std::fprintf(stderr, "flashd version: unexpected argument \"%s\"\n", args[0].c_str());
    return kExitUsage;
  }
  std::printf("flashd %s (%s build, %s)\n", kVersion, kBuildType, kBackends);
  return kExitOk;
}

int Serve(const std::vector<std::string>& args) {
  if (WantsHelp(args)) {
    PrintServeHelp();
    return kExitOk;
  }
  std::string config_path;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config" && i + 1 < args.size()) {
      config_path = args[++i];
    } else if (args[i].rfind("--config=", 0) == 0) {
      config_path = args[i].substr(9);
    } else {
      std::fprintf(stderr, "flashd serve: unexpected argument \"%s\" (see flashd serve --help)\n",
                   args[i].c_str());
      return kExitUsage;
    }
  }
  EnvLookup env = ProcessEnvironment();
  if (config_path.empty()) {
    if (auto from_env = env("FLASHD_CONFIG"); from_env && !from_env->empty()) {
      config_path = *from_env;
    } else if (std::filesystem::exists(kDefaultConfigPath)) {
      config_path = kDefaultConfigPath;
    }
  }

  StatusOr<Config> config =
      config_path.empty() ? StatusOr<Config>(Config()) : LoadConfigFile(config_path);
  if (!config.ok()) {
    std::fprintf(stderr, "flashd: %s\n", config.status().message().c_str());
    return kExitUsage;
  }
  if (Status s = ApplyEnvironment(&*config, env); !s.ok()) {
    std::fprintf(stderr, "flashd: %s\n", s.message().c_str());
    return kExitUsage;
  }
  if (Status s = PrepareDirectories(*config); !s.ok()) {
    std::fprintf(stderr, "flashd: %s\n", s.message().c_str());
    return kExitUsage;
  }

  // Everything the daemon writes from here on (cache, catalog, generated model, pid file) is
  // its user's alone; the socket's mode is set explicitly (server.socket_mode).
  ::umask(0077);

  spdlog::set_level(spdlog::level::from_str(config->log.level));
  spdlog::info("flashd {} starting (config: {})", kVersion,
               config_path.empty() ? "built-in defaults" : config_path);
  if (std::vector<std::string> exposed = ExposedStateFiles(*config); !exposed.empty()) {
    std::string list;
    for (const std::string& p : exposed) list += (list.empty() ? "" : " ") + p;
    spdlog::warn(
        "other users can read the daemon's state (conversations, cached prompts): {}; "
        "restrict it with: chmod -R go-rwx {}",
        list, config->state_dir);
  }

  // A client that disconnects mid-response must not kill the daemon.
  ::signal(SIGPIPE, SIG_IGN);
  // A file-size limit must fail a write (the prefix cache then stops writing and serving goes
  // on), not kill the daemon.
  ::signal(SIGXFSZ, SIG_IGN);
  auto daemon = daemon::Daemon::Start(*config, config_path);
  if (!daemon.ok()) {
    spdlog::error("{}", daemon.status().message());
    std::fprintf(stderr, "flashd: %s\n", daemon.status().message().c_str());
    return kExitFailure;
  }
  return (*daemon)->Run();
}

}  // namespace
}  // namespace flashd

int main(int argc, char** argv) {
  using namespace flashd;
  // Logs go to stderr for every command, so stdout carries only a command's output.
  spdlog::set_default_logger(spdlog::stderr_color_mt("flashd"));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    PrintMainHelp();
    return kExitUsage;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  if (command == "serve") return Serve(args);
  if (command == "version" || command == "--version") return Version(args);
  if (command == "mkmodel") return daemon::MkModelCommand(args);
  if (command == "eval") return daemon::EvalCommand(args);
  if (command == "model-info") return daemon::ModelInfoCommand(args);
  if (command == "plan") return daemon::PlanCommand(args);
  if (command == "tokenize") return daemon::TokenizeCommand(args);
  if (command == "detokenize") return daemon::DetokenizeCommand(args);
  if (command == "help" || command == "--help" || command == "-h") {
    PrintMainHelp();
    return kExitOk;
  }
  std::fprintf(stderr, "flashd: unknown command \"%s\" (see flashd --help)\n", command.c_str());
  return kExitUsage;
}
