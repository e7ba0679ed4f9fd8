// HttpFront: the HTTP/1.1 side of `sparsejax serve`'s prediction path, outside the GIL
// (sparsejax/serving/_front.py).
//
// One thread accepts connections on a listening socket the server made and reads and
// frames their requests. A `POST` to one of its paths with a Content-Length body is
// queued for Python, which takes the bodies in batches (`take`), scores them and answers them in
// batches (`respond`, which leaves them for this thread to send). Answers go out in the
// order their requests came on each connection (HTTP/1.1 pipelining); a connection with
// 64 requests unanswered is not read until answers go out, one idle for the keep-alive
// timeout with none in flight is closed, and out of file descriptors the loop stops
// accepting for 0.1 s instead of spinning on the listening socket. A v2 request with
// binary tensors comes with the value of its Inference-Header-Content-Length header.
// Anything else - another method or path, chunked bodies, `Expect`, HTTP/1.0, a body
// over the limit, a header block over 16 KiB - hands the connection over: once its
// answers are out, it leaves this loop and Python's HTTP server (aiohttp) takes it, with the bytes read so
// far (`take_handoffs`, woken by `handoff_fd`). So every request this loop does not know
// is answered exactly as before, by the one implementation of the API.
//
// Python's per-request cost drops to its JSON parse and answer; the accept, read,
// framing and write that an asyncio server does in Python run here, on any core. The
// batcher's worker thread waits in `take` when it is idle and takes the requests in
// bunches when it is busy, so no thread is woken per request.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace sparsejax {
namespace {

constexpr size_t kMaxHeader = 16 * 1024;  // larger header blocks go to aiohttp
constexpr uint32_t kMaxInFlight = 64;      // a connection's requests queued and not answered
constexpr double kAcceptPauseS = 0.1;      // out of file descriptors: accept again after this
constexpr uint64_t kListenTag = 0, kWakeTag = 1;  // epoll tags; connections count from 2

struct Conn {
  int fd = -1;
  std::string in;                  // read, not yet framed
  std::string out;                 // answers not yet sent
  uint32_t next_seq = 0;           // the sequence number of the next request framed
  uint32_t send_seq = 0;           // the sequence number of the next answer to send
  std::unordered_map<uint32_t, std::string> ready;  // answers waiting for earlier ones
  bool reading = true;             // EPOLLIN wanted
  bool throttled = false;          // kMaxInFlight requests unanswered: framing waits
  double last_active = 0;          // when it last sent a byte or was answered (Monotonic)
  bool writing = false;            // EPOLLOUT registered
  bool handoff = false;            // stop framing; hand over once its answers are out
  bool last_framed = false;        // a request said Connection: close; frame no more
  bool close_after = false;        // close once its answers are out (Connection: close, EOF)
};

struct Request {
  uint64_t token;  // connection id << 32 | sequence number
  std::string body;
  double arrived;  // CLOCK_MONOTONIC seconds (Python's time.monotonic) when framed
  int route;       // which of the front's paths it was posted to
  bool has_json_length;     // an Inference-Header-Content-Length header (v2 binary tensors)
  std::string json_length;  // its value as sent (Python checks it)
};

constexpr size_t kMaxJsonLengthValue = 32;  // a longer header value goes to aiohttp

double Monotonic() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

bool IEquals(const char* a, size_t n, const char* b) {
  return strlen(b) == n && strncasecmp(a, b, n) == 0;
}

bool IContains(const char* a, size_t n, const char* word) {
  const size_t w = strlen(word);
  for (size_t i = 0; i + w <= n; ++i) {
    if (strncasecmp(a + i, word, w) == 0) return true;
  }
  return false;
}

const char* Reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 413: return "Request Entity Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

class Front {
 public:
  Front(int listen_fd, std::vector<std::string> paths, size_t max_body, double idle_timeout_s)
      : listen_fd_(listen_fd),
        paths_(std::move(paths)),
        max_body_(max_body),
        idle_timeout_s_(idle_timeout_s) {}

  // Errno of the failing call, 0 on success.
  int Start() {
    epoll_ = epoll_create1(EPOLL_CLOEXEC);
    wake_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    handoff_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epoll_ < 0 || wake_ < 0 || handoff_fd_ < 0) return errno;
    const int flags = fcntl(listen_fd_, F_GETFL);
    if (flags < 0 || fcntl(listen_fd_, F_SETFL, flags | O_NONBLOCK) < 0) return errno;
    if (Watch(listen_fd_, kListenTag, EPOLLIN, EPOLL_CTL_ADD) < 0) return errno;
    if (Watch(wake_, kWakeTag, EPOLLIN, EPOLL_CTL_ADD) < 0) return errno;
    thread_ = std::thread([this] { Loop(); });
    return 0;
  }

  ~Front() {
    Close();
    for (int fd : {epoll_, wake_, handoff_fd_}) {
      if (fd >= 0) close(fd);
    }
  }

  int handoff_fd() const { return handoff_fd_; }
  int connections() const { return connections_.load(std::memory_order_relaxed); }

  // Up to `max_n` queued requests, waiting up to `timeout_s` (< 0: for ever) for the
  // first or a `Wake`; false once shut down and drained.
  bool Take(size_t max_n, double timeout_s, std::vector<Request>* out) {
    std::unique_lock<std::mutex> lock(queue_mu_);
    const auto ready = [this] { return !queue_.empty() || shut_ || woken_; };
    if (timeout_s < 0) {
      taken_.wait(lock, ready);
    } else {
      taken_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready);
    }
    woken_ = false;
    while (!queue_.empty() && out->size() < max_n) {
      out->push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    return !(out->empty() && shut_);
  }

  // Make a waiting (or the next) `Take` return now.
  void Wake() {
    std::lock_guard<std::mutex> lock(queue_mu_);
    woken_ = true;
    taken_.notify_all();
  }

  // Answers, each (token, full HTTP response), for the loop's thread to send (the
  // caller, Python's batcher, goes back to work at once); those of closed connections
  // are dropped.
  void Respond(std::vector<std::pair<uint64_t, std::string>>* answers) {
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(outbox_mu_);
      if (outbox_.empty()) {
        outbox_.swap(*answers);
      } else {
        for (auto& a : *answers) outbox_.push_back(std::move(a));
      }
      wake = !outbox_woken_;
      outbox_woken_ = true;
    }
    if (wake) {
      uint64_t one = 1;
      (void)!write(wake_, &one, sizeof one);
    }
  }

  // Connections handed over since the last call: (fd, the bytes read from it so far).
  std::vector<std::pair<int, std::string>> TakeHandoffs() {
    uint64_t n;
    (void)!read(handoff_fd_, &n, sizeof n);
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::pair<int, std::string>> out;
    out.swap(handoffs_);
    return out;
  }

  // Stop accepting and framing new requests; `Take` returns what is queued, then false.
  void Shutdown() {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_) return;
    shut_ = true;
    epoll_ctl(epoll_, EPOLL_CTL_DEL, listen_fd_, nullptr);
    for (auto& [id, conn] : conns_) SetReading(id, &conn, false);
    std::lock_guard<std::mutex> queue_lock(queue_mu_);  // a `Take` waiting sees shut_
    taken_.notify_all();
  }

  // Shut down, stop the thread and close every connection it still holds.
  void Close() {
    Shutdown();
    if (thread_.joinable()) {
      stopping_ = true;
      uint64_t one = 1;
      (void)!write(wake_, &one, sizeof one);
      thread_.join();
    }
    std::lock_guard<std::mutex> lock(mu_);
    SendOutbox();  // the answers left since the loop's last round
    for (auto& [id, conn] : conns_) close(conn.fd);
    conns_.clear();
    for (auto& [fd, bytes] : handoffs_) close(fd);
    handoffs_.clear();
    connections_ = 0;
  }

 private:
  int Watch(int fd, uint64_t tag, uint32_t events, int op) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = tag;
    return epoll_ctl(epoll_, op, fd, &ev);
  }

  void Rewatch(uint64_t id, Conn* c) {
    Watch(c->fd, id, (c->reading ? EPOLLIN : 0) | (c->writing ? EPOLLOUT : 0), EPOLL_CTL_MOD);
  }

  void SetReading(uint64_t id, Conn* c, bool on) {
    if (c->reading == on) return;
    c->reading = on;
    Rewatch(id, c);
  }

  void Loop() {
    epoll_event events[256];
    std::vector<char> buf(1 << 16);
    double next_sweep = Monotonic() + 1.0;
    while (!stopping_) {
      const int n = epoll_wait(epoll_, events, 256, accept_paused_ ? 100 : 1000);
      if (n < 0) {
        if (errno == EINTR) continue;
        break;
      }
      std::lock_guard<std::mutex> lock(mu_);
      const double now = Monotonic();
      if (accept_paused_ && now >= accept_resume_at_ && !shut_) {
        accept_paused_ = false;
        Watch(listen_fd_, kListenTag, EPOLLIN, EPOLL_CTL_ADD);
      }
      if (now >= next_sweep) {
        next_sweep = now + 1.0;
        CloseIdle(now);
      }
      SendOutbox();
      for (int i = 0; i < n; ++i) {
        const uint64_t tag = events[i].data.u64;
        if (tag == kWakeTag) {
          uint64_t v;
          (void)!read(wake_, &v, sizeof v);
        } else if (tag == kListenTag) {
          Accept();
        } else {
          auto it = conns_.find(tag);
          if (it == conns_.end()) continue;  // closed earlier in this round
          if (events[i].events & EPOLLOUT) Flush(tag);
          it = conns_.find(tag);
          if (it == conns_.end()) continue;
          if (it->second.reading && (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP))) {
            Read(tag, &it->second, buf.data(), buf.size());
          } else if (events[i].events & (EPOLLERR | EPOLLHUP)) {
            Drop(tag);  // gone while its answers were being computed
          }
        }
      }
    }
  }

  void Accept() {
    if (shut_) return;
    while (true) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // the listening socket stays readable: stop watching it for a while rather
          // than spin (the clients wait in the backlog)
          epoll_ctl(epoll_, EPOLL_CTL_DEL, listen_fd_, nullptr);
          accept_paused_ = true;
          accept_resume_at_ = Monotonic() + kAcceptPauseS;
        }
        return;  // EAGAIN: none left
      }
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      const uint64_t id = next_id_++;
      Conn& c = conns_[id];
      c.fd = fd;
      c.last_active = Monotonic();
      connections_.fetch_add(1, std::memory_order_relaxed);
      if (Watch(fd, id, EPOLLIN, EPOLL_CTL_ADD) < 0) Drop(id);
    }
  }

  // Close the connections with nothing in flight that were quiet for the idle timeout
  // (aiohttp's keep-alive timeout), so abandoned ones do not hold their descriptors.
  void CloseIdle(double now) {
    std::vector<uint64_t> idle;
    for (auto& [id, c] : conns_) {
      if (c.send_seq == c.next_seq && c.out.empty() && now - c.last_active > idle_timeout_s_) {
        idle.push_back(id);
      }
    }
    for (uint64_t id : idle) Drop(id);
  }

  void Read(uint64_t id, Conn* c, char* buf, size_t size) {
    while (true) {
      const ssize_t got = recv(c->fd, buf, size, 0);
      if (got > 0) {
        c->in.append(buf, static_cast<size_t>(got));
        c->last_active = Monotonic();
        if (static_cast<size_t>(got) < size) break;
        continue;
      }
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (got < 0 && errno == EINTR) continue;
      // EOF or an error: answer what was asked (a half-closed client still reads), then close
      if (got < 0) {
        Drop(id);
        return;
      }
      c->close_after = true;
      SetReading(id, c, false);
      break;
    }
    Frame(id, c);
    Finish(id);
  }

  // Queue every whole request in c->in, or mark the connection for hand-over.
  void Frame(uint64_t id, Conn* c) {
    size_t pos = 0;
    std::vector<Request> framed;
    while (!c->handoff && !c->last_framed) {
      if (c->next_seq - c->send_seq >= kMaxInFlight) {  // read on once answers go out
        c->throttled = true;
        break;
      }
      const char* data = c->in.data() + pos;
      const size_t avail = c->in.size() - pos;
      const char* end = static_cast<const char*>(
          memmem(data, std::min(avail, kMaxHeader + 4), "\r\n\r\n", 4));
      if (end == nullptr) {
        if (avail > kMaxHeader) c->handoff = true;
        break;
      }
      const size_t header_len = static_cast<size_t>(end - data) + 4;
      size_t body_len = 0;
      bool close = false;
      int route = 0;
      const char* json_length = nullptr;
      size_t json_length_len = 0;
      if (!FastRequest(data, header_len, &body_len, &close, &route, &json_length,
                       &json_length_len)) {
        c->handoff = true;
        break;
      }
      if (avail - header_len < body_len) break;  // the body is still coming
      framed.push_back({id << 32 | c->next_seq++, std::string(data + header_len, body_len),
                        Monotonic(), route, json_length != nullptr,
                        json_length == nullptr ? std::string()
                                               : std::string(json_length, json_length_len)});
      pos += header_len + body_len;
      if (close) c->last_framed = c->close_after = true;  // Connection: close
    }
    c->in.erase(0, pos);
    if (c->handoff || c->last_framed || c->throttled) SetReading(id, c, false);
    if (!framed.empty()) {
      std::lock_guard<std::mutex> lock(queue_mu_);
      for (auto& r : framed) queue_.push_back(std::move(r));
      taken_.notify_one();
    }
  }

  // Put the answers `Respond` left on their connections, in order, and send them.
  void SendOutbox() {
    std::vector<std::pair<uint64_t, std::string>> answers;
    {
      std::lock_guard<std::mutex> lock(outbox_mu_);
      answers.swap(outbox_);
      outbox_woken_ = false;
    }
    std::vector<uint64_t> touched;
    for (auto& [token, response] : answers) {
      const uint64_t id = token >> 32;
      auto it = conns_.find(id);
      if (it == conns_.end()) continue;  // the client went away
      it->second.ready.emplace(static_cast<uint32_t>(token), std::move(response));
      if (touched.empty() || touched.back() != id) touched.push_back(id);
    }
    for (uint64_t id : touched) Flush(id);
  }

  // Whether the header block is a request this loop answers; its body's length, which
  // of the paths it was posted to, and its Inference-Header-Content-Length value (the
  // JSON part of a v2 body with binary tensors; null if none).
  bool FastRequest(const char* h, size_t len, size_t* body_len, bool* close_after, int* route,
                   const char** json_length, size_t* json_length_len) const {
    const char* line_end = static_cast<const char*>(memmem(h, len, "\r\n", 2));
    if (line_end == nullptr) return false;
    const size_t line_len = static_cast<size_t>(line_end - h);
    *route = -1;
    for (size_t i = 0; i < paths_.size(); ++i) {  // "POST " + path + " HTTP/1.1"
      const std::string& path = paths_[i];
      if (line_len == path.size() + 14 && memcmp(h, "POST ", 5) == 0 &&
          memcmp(h + 5, path.data(), path.size()) == 0 &&
          memcmp(h + 5 + path.size(), " HTTP/1.1", 9) == 0) {
        *route = static_cast<int>(i);
        break;
      }
    }
    if (*route < 0) return false;
    bool have_length = false;
    const char* p = line_end + 2;
    const char* stop = h + len - 2;  // the final empty line
    while (p < stop) {
      const char* e = static_cast<const char*>(memmem(p, stop - p + 2, "\r\n", 2));
      const char* colon = static_cast<const char*>(memchr(p, ':', e - p));
      if (colon == nullptr || colon == p) return false;
      const size_t name_len = colon - p;
      const char* v = colon + 1;
      while (v < e && (*v == ' ' || *v == '\t')) ++v;
      const char* ve = e;
      while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t')) --ve;
      if (IEquals(p, name_len, "content-length")) {
        if (have_length || v == ve || ve - v > 12) return false;
        size_t n = 0;
        for (const char* d = v; d < ve; ++d) {
          if (*d < '0' || *d > '9') return false;
          n = n * 10 + static_cast<size_t>(*d - '0');
        }
        if (n > max_body_) return false;  // aiohttp answers 413
        *body_len = n;
        have_length = true;
      } else if (IEquals(p, name_len, "inference-header-content-length")) {
        if (*json_length != nullptr || ve - v > static_cast<ptrdiff_t>(kMaxJsonLengthValue))
          return false;
        *json_length = v;
        *json_length_len = static_cast<size_t>(ve - v);
      } else if (IEquals(p, name_len, "transfer-encoding") || IEquals(p, name_len, "expect") ||
                 IEquals(p, name_len, "upgrade")) {
        return false;
      } else if (IEquals(p, name_len, "connection")) {
        if (IContains(v, ve - v, "upgrade")) return false;
        if (IContains(v, ve - v, "close")) *close_after = true;
      }
      p = e + 2;
    }
    return have_length;
  }

  // Send the answers that are next in order; EPOLLOUT for what the socket did not take.
  void Flush(uint64_t id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    Conn* c = &it->second;
    for (auto r = c->ready.find(c->send_seq); r != c->ready.end();
         r = c->ready.find(c->send_seq)) {
      c->out += r->second;
      c->ready.erase(r);
      ++c->send_seq;
      c->last_active = Monotonic();
    }
    if (c->throttled && c->next_seq - c->send_seq < kMaxInFlight) {
      c->throttled = false;
      SetReading(id, c, !c->close_after);  // not after EOF
      Frame(id, c);  // what it sent meanwhile
    }
    size_t sent = 0;
    while (sent < c->out.size()) {
      const ssize_t k = send(c->fd, c->out.data() + sent, c->out.size() - sent,
                             MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        sent += static_cast<size_t>(k);
      } else if (k < 0 && errno == EINTR) {
        continue;
      } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        break;
      } else {
        Drop(id);
        return;
      }
    }
    c->out.erase(0, sent);
    const bool want_out = !c->out.empty();
    if (want_out != c->writing) {
      c->writing = want_out;
      Rewatch(id, c);
    }
    Finish(id);
  }

  // Close or hand over a connection whose answers are all out.
  void Finish(uint64_t id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    Conn* c = &it->second;
    if (!c->out.empty() || c->send_seq != c->next_seq) return;
    if (c->handoff) {
      epoll_ctl(epoll_, EPOLL_CTL_DEL, c->fd, nullptr);
      handoffs_.emplace_back(c->fd, std::move(c->in));
      conns_.erase(it);
      connections_.fetch_sub(1, std::memory_order_relaxed);
      uint64_t one = 1;
      (void)!write(handoff_fd_, &one, sizeof one);
    } else if (c->close_after) {
      Drop(id);
    }
  }

  void Drop(uint64_t id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    int fd = it->second.fd;
    conns_.erase(it);
    // Counted out before the close: a peer that sees the close must not see it counted.
    connections_.fetch_sub(1, std::memory_order_relaxed);
    close(fd);  // also takes it out of the epoll set
  }

  const int listen_fd_;
  const std::vector<std::string> paths_;
  const size_t max_body_;
  const double idle_timeout_s_;
  bool accept_paused_ = false;
  double accept_resume_at_ = 0;
  int epoll_ = -1, wake_ = -1, handoff_fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> connections_{0};
  std::mutex mu_;  // the connections and the loop's state (held by the loop's rounds)
  std::unordered_map<uint64_t, Conn> conns_;
  uint64_t next_id_ = 2;
  std::vector<std::pair<int, std::string>> handoffs_;
  std::atomic<bool> shut_{false};  // written under mu_; `Take` reads it under queue_mu_
  // the framed requests, for `Take` (never held across a send, so Python does not wait
  // for the loop's writes)
  std::mutex queue_mu_;
  std::condition_variable taken_;
  std::deque<Request> queue_;
  bool woken_ = false;
  // the answers `Respond` left for the loop
  std::mutex outbox_mu_;
  std::vector<std::pair<uint64_t, std::string>> outbox_;
  bool outbox_woken_ = false;
};

// -- the Python type -----------------------------------------------------------------------

struct PyFront {
  PyObject_HEAD Front* front;
};

Front* FrontOf(PyObject* self) {
  Front* f = reinterpret_cast<PyFront*>(self)->front;
  if (f == nullptr) PyErr_SetString(PyExc_RuntimeError, "HttpFront is closed");
  return f;
}

PyObject* FrontNew(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"listen_fd", "paths", "max_body", "idle_timeout_s", nullptr};
  int fd;
  PyObject* path_seq;
  long long max_body;
  double idle_timeout = 75.0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOL|d", const_cast<char**>(kwlist), &fd,
                                   &path_seq, &max_body, &idle_timeout)) {
    return nullptr;
  }
  std::vector<std::string> paths;
  PyObject* seq = PySequence_Fast(path_seq, "HttpFront: paths must be a list of str");
  if (seq == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    Py_ssize_t len;
    const char* path = PyUnicode_AsUTF8AndSize(PySequence_Fast_GET_ITEM(seq, i), &len);
    if (path == nullptr) {
      Py_DECREF(seq);
      return nullptr;
    }
    paths.emplace_back(path, static_cast<size_t>(len));
  }
  Py_DECREF(seq);
  if (paths.empty()) {
    PyErr_SetString(PyExc_ValueError, "HttpFront: paths must name at least one path");
    return nullptr;
  }
  if (max_body < 0) {
    PyErr_Format(PyExc_ValueError, "HttpFront: max_body must be >= 0, got %lld", max_body);
    return nullptr;
  }
  PyFront* self = reinterpret_cast<PyFront*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->front = new Front(fd, std::move(paths), static_cast<size_t>(max_body), idle_timeout);
  if (const int err = self->front->Start()) {
    delete self->front;
    self->front = nullptr;
    Py_DECREF(self);
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  return reinterpret_cast<PyObject*>(self);
}

void FrontDealloc(PyObject* obj) {
  PyFront* self = reinterpret_cast<PyFront*>(obj);
  if (self->front != nullptr) {
    Py_BEGIN_ALLOW_THREADS delete self->front;
    Py_END_ALLOW_THREADS self->front = nullptr;
  }
  PyTypeObject* type = Py_TYPE(obj);
  type->tp_free(obj);
  Py_DECREF(type);
}

PyObject* FrontTake(PyObject* self, PyObject* args) {
  Py_ssize_t max_n;
  double timeout;
  if (!PyArg_ParseTuple(args, "nd", &max_n, &timeout)) return nullptr;
  Front* f = FrontOf(self);
  if (f == nullptr) return nullptr;
  std::vector<Request> got;
  const size_t n = static_cast<size_t>(std::max<Py_ssize_t>(max_n, 1));
  bool open;
  if (timeout == 0) {  // a sweep: a short lock, no wait, so the GIL stays (giving it up
    open = f->Take(n, 0, &got);  // could hand it to another thread for a switch interval)
  } else {
    Py_BEGIN_ALLOW_THREADS open = f->Take(n, timeout, &got);
    Py_END_ALLOW_THREADS
  }
  if (!open) Py_RETURN_NONE;
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(got.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < got.size(); ++i) {
    const Request& r = got[i];
    PyObject* item = Py_BuildValue(
        "(Ky#diz#)", static_cast<unsigned long long>(r.token), r.body.data(),
        static_cast<Py_ssize_t>(r.body.size()), r.arrived, r.route,
        r.has_json_length ? r.json_length.data() : nullptr,
        static_cast<Py_ssize_t>(r.json_length.size()));
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

PyObject* FrontRespond(PyObject* self, PyObject* arg) {
  Front* f = FrontOf(self);
  if (f == nullptr) return nullptr;
  PyObject* seq = PySequence_Fast(arg, "respond: expected a list of (token, status, body)");
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  std::vector<std::pair<uint64_t, std::string>> answers;
  answers.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    unsigned long long token;
    int status;
    const char* body;
    Py_ssize_t body_len;
    const char* headers = "Content-Type: application/json; charset=utf-8\r\n";
    Py_ssize_t headers_len = static_cast<Py_ssize_t>(strlen(headers));
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "Kiy#|y#", &token, &status, &body,
                          &body_len, &headers, &headers_len)) {
      Py_DECREF(seq);
      return nullptr;
    }
    char status_line[64];
    const int k = snprintf(status_line, sizeof status_line, "HTTP/1.1 %d %s\r\n", status,
                           Reason(status));
    char length_line[64];
    const int m = snprintf(length_line, sizeof length_line, "Content-Length: %zd\r\n\r\n",
                           body_len);
    std::string response;
    response.reserve(static_cast<size_t>(k + headers_len + m + body_len));
    response.append(status_line, static_cast<size_t>(k));
    response.append(headers, static_cast<size_t>(headers_len));
    response.append(length_line, static_cast<size_t>(m));
    response.append(body, static_cast<size_t>(body_len));
    answers.emplace_back(static_cast<uint64_t>(token), std::move(response));
  }
  Py_DECREF(seq);
  f->Respond(&answers);  // a lock held for a swap, and an eventfd write: the GIL stays
  Py_RETURN_NONE;
}

PyObject* FrontTakeHandoffs(PyObject* self, PyObject*) {
  Front* f = FrontOf(self);
  if (f == nullptr) return nullptr;
  std::vector<std::pair<int, std::string>> got = f->TakeHandoffs();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(got.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < got.size(); ++i) {
    PyObject* item = Py_BuildValue("(iy#)", got[i].first, got[i].second.data(),
                                   static_cast<Py_ssize_t>(got[i].second.size()));
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

PyObject* FrontWake(PyObject* self, PyObject*) {
  Front* f = reinterpret_cast<PyFront*>(self)->front;
  if (f != nullptr) f->Wake();
  Py_RETURN_NONE;
}

PyObject* FrontShutdown(PyObject* self, PyObject*) {
  Front* f = FrontOf(self);
  if (f == nullptr) return nullptr;
  Py_BEGIN_ALLOW_THREADS f->Shutdown();
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

PyObject* FrontClose(PyObject* obj, PyObject*) {
  PyFront* self = reinterpret_cast<PyFront*>(obj);
  Front* f = self->front;
  self->front = nullptr;
  if (f != nullptr) {
    Py_BEGIN_ALLOW_THREADS delete f;
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

PyObject* FrontConnections(PyObject* self, PyObject*) {
  Front* f = reinterpret_cast<PyFront*>(self)->front;
  return PyLong_FromLong(f == nullptr ? 0 : f->connections());
}

PyObject* FrontHandoffFd(PyObject* self, PyObject*) {
  Front* f = FrontOf(self);
  if (f == nullptr) return nullptr;
  return PyLong_FromLong(f->handoff_fd());
}

PyMethodDef kFrontMethods[] = {
    {"take", FrontTake, METH_VARARGS,
     "take(max_n, timeout_s) -> [(token, body: bytes, arrived: time.monotonic() seconds, "
     "route: the index of its path, its Inference-Header-Content-Length value: str or "
     "None)] (up to max_n; [] on timeout or wake; timeout_s < 0: no timeout), or None once "
     "shut down and drained."},
    {"wake", FrontWake, METH_NOARGS, "Make a waiting (or the next) take() return now."},
    {"respond", FrontRespond, METH_O,
     "respond([(token, status, body: bytes[, headers: bytes])]): leave each answer for the "
     "front's thread to send on its connection, in request order (dropped if the client went "
     "away); headers (\"Name: value\\r\\n\" lines) replace the JSON Content-Type."},
    {"take_handoffs", FrontTakeHandoffs, METH_NOARGS,
     "take_handoffs() -> [(fd, bytes read so far)]: the connections handed over; the caller "
     "owns the fds."},
    {"shutdown", FrontShutdown, METH_NOARGS,
     "Stop accepting connections and reading requests; take() drains the queue, then None."},
    {"close", FrontClose, METH_NOARGS, "Stop the thread and close every connection it holds."},
    {"connections", FrontConnections, METH_NOARGS, "Open connections this loop serves."},
    {"handoff_fd", FrontHandoffFd, METH_NOARGS,
     "An eventfd readable when connections were handed over."},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot kFrontSlots[] = {
    {Py_tp_new, reinterpret_cast<void*>(FrontNew)},
    {Py_tp_dealloc, reinterpret_cast<void*>(FrontDealloc)},
    {Py_tp_methods, kFrontMethods},
    {Py_tp_doc, const_cast<char*>("HttpFront(listen_fd, path, max_body, idle_timeout_s=75): "
                                  "frames `POST path` requests of a listening socket outside "
                                  "the GIL (csrc/http_front.cc).")},
    {0, nullptr},
};

PyType_Spec kFrontSpec = {
    "sparsejax._cpu_ext.HttpFront", sizeof(PyFront), 0, Py_TPFLAGS_DEFAULT, kFrontSlots,
};

}  // namespace

// Adds HttpFront to the module; -1 with an exception set on failure.
int AddHttpFront(PyObject* module) {
  PyObject* type = PyType_FromSpec(&kFrontSpec);
  if (type == nullptr) return -1;
  if (PyModule_AddObject(module, "HttpFront", type) < 0) {
    Py_DECREF(type);
    return -1;
  }
  return 0;
}

}  // namespace sparsejax
