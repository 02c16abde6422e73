#include "core/host_identity.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>

namespace torchpar::detail {
namespace {

/// The first line of `path`, without trailing blanks; empty when unreadable.
std::string first_line(const char* path) {
  std::ifstream f(path);
  std::string s;
  if (!f || !std::getline(f, s)) return {};
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

/// stat(path): the inode (or the device), 0 when it fails.
uint64_t stat_field(const char* path, bool device) {
  struct stat st {};
  if (::stat(path, &st) != 0) return 0;
  return static_cast<uint64_t>(device ? st.st_dev : st.st_ino);
}

uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 14695981039346656037ull;
  for (const char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

std::string HostIdentity::key() const {
  return fmt::format("{}/{}/{:x}/{:x}/{:x}", host_name, boot_id, pid_ns, net_ns, shm_dev);
}

std::string HostIdentity::token() const {
  if (boot_id.empty() || net_ns == 0) return {};
  std::string t = fmt::format("{}_{:016x}", boot_id, fnv1a64(key()));
  return is_host_token(t) ? t : std::string();
}

HostIdentity this_host() {
  HostIdentity id;
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  id.host_name = host;
  id.boot_id = first_line("/proc/sys/kernel/random/boot_id");
  id.pid_ns = stat_field("/proc/self/ns/pid", false);
  id.net_ns = stat_field("/proc/self/ns/net", false);
  id.shm_dev = stat_field("/dev/shm", true);
  return id;
}

std::string host_key() { return this_host().key(); }

bool is_host_token(std::string_view token) {
  return !token.empty() && token.size() <= kMaxHostToken &&
         std::all_of(token.begin(), token.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || c == '_' || c == '-';
         });
}

}  // namespace torchpar::detail
