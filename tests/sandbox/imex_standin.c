/* Test stand-in for the NVIDIA IMEX daemon (nvidia-imex), in C: the same daemon as
 * tests/sandbox/imex_standin.py, whose module docstring is the behaviour contract and whose
 * code is the reference, for plain TCP peer links (no TLS).
 *
 * Why C (issue 27): the benchmarks run 18 stand-ins on 2 cores, and the Python daemon's own
 * cost per change (an interpreter start of ~90 CPU-ms on every restart, ~8 CPU-ms per
 * SIGUSR1 round of 17 reconnects) dwarfed what the real C++ nvidia-imex spends. This one
 * costs what a small C daemon costs. tests/sandbox/bin/nvidia-imex runs it when
 * IMEX_STANDIN_IMPL=c; a config with mutual TLS is refused, saying so (the sandbox keeps
 * such an ensemble on the Python daemon); tests/sandbox/ctl_build.py (standin_daemon)
 * builds it with the system's gcc.
 *
 * Everything a test, a peer or a benchmark can see is the Python's: the command line and
 * its usage errors, config.cfg's rules and error texts, the log lines (same format, words
 * and levels), the wire (hello, ping and pong lines: a mixed ensemble of Python and C
 * daemons interoperates), the command port's replies (nvidia-imex-ctl prints the same),
 * the state file (event_loop "c") and the attempt log. Floats print as their shortest
 * round-trip form, as Python's repr does.
 *
 * Structure: one epoll loop over non-blocking sockets; no thread of its own, no thread per
 * peer (epoll rather than poll(): a sandbox kernel such as gVisor pays per descriptor on
 * every poll() call, and a node of 18 holds 34 links; the keepalive's CPU fell by 40 %).
 * Signals reach the loop through a self-pipe (a handler per delivery, as Python's C
 * handler counts them). Names in /etc/hosts are resolved here, the file parsed again only
 * when it changed (HostsFile); any other name goes to glibc's getaddrinfo_a, whose
 * completion signal comes through the same pipe: a DNS lookup that hangs never holds up
 * the loop, the keepalive, a ctl answer or SIGTERM (glibc runs the lookup in its own
 * helper thread, which exit() does not wait for). Each outgoing link is a small state
 * machine (wait, resolve, connect, hello, up) stepped by the loop; one 0.5 s keepalive
 * pass pings every link and drops the silent ones; the state file is written at most once
 * per turn of the loop. JSON lines from peers and the ctl go through a strict parser that
 * reproduces Python's json.loads, its error texts included; bad input closes that
 * connection with a log line, never the daemon.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ the Python's constants */

#define DEFAULT_VERSION "580.82.07"
#define DEFAULT_CONFIG "/etc/nvidia-imex/config.cfg"
#define NO_MATCH_MESSAGE \
    "No matching network interface found for any IP addresses in the node configuration file"
#define USR1_WINDOW_S 5.0
#define RETRY_FIRST_S 0.5
#define RETRY_MAX_S 3.0
#define PING_INTERVAL_S 0.5
#define PEER_TIMEOUT_S 3.0
#define CONNECT_TIMEOUT_S 2.0
#define CMD_TIMEOUT_S 5.0
#define SIGNAL_LOG_MAX 200
#define MAX_LINE (64 * 1024)    /* the longest line a link accepts (LineLink) */
#define READ_CHUNK (256 * 1024) /* one read, as uvloop's: the MAX_LINE check is per read */
#define INT_MAX_STR_DIGITS 4300 /* Python's int() limit, which json.loads hits */
#define JSON_MAX_DEPTH 980      /* about where Python's recursion limit stops json.loads */

static const char PING_LINE[] = "{\"type\":\"ping\"}\n";
static const char PONG_LINE[] = "{\"type\":\"pong\"}\n";
static const char *const STATES[] = {
    "INITIALIZING", "STARTING_AUTH_SERVER", "WAITING_FOR_PEERS", "WAITING_FOR_RECOVERY",
    "INIT_GPU", "READY", "SHUTTING_DOWN", "UNAVAILABLE"};
#define NSTATES (int)(sizeof STATES / sizeof *STATES)

/* ------------------------------------------------------------------ small utilities */

static void *xrealloc(void *p, size_t n) {
    p = realloc(p, n ? n : 1);
    if (!p) {
        static const char msg[] = "nvidia-imex: out of memory\n";
        if (write(2, msg, sizeof msg - 1) < 0) { /* nothing left to tell */ }
        _exit(1);
    }
    return p;
}
static void *xmalloc(size_t n) { return xrealloc(NULL, n); }
static void *xcalloc(size_t n) { return memset(xmalloc(n), 0, n); }
static char *xstrndup(const char *s, size_t n) {
    char *p = xmalloc(n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}
static char *xstrdup(const char *s) { return xstrndup(s, strlen(s)); }
static void set_str(char **slot, const char *s) { /* s may be *slot's own text */
    char *copy = s ? xstrdup(s) : NULL;
    free(*slot);
    *slot = copy;
}
static int str_eq(const char *a, const char *b) {
    return (a == NULL && b == NULL) || (a && b && !strcmp(a, b));
}

/* A growing string: every text this daemon writes is built in one. */
typedef struct { char *p; size_t n, cap; } sb;

static void sb_reserve(sb *b, size_t add) {
    if (b->n + add + 1 <= b->cap) return;
    size_t c = b->cap ? b->cap : 64;
    while (c < b->n + add + 1) c *= 2;
    b->p = xrealloc(b->p, c);
    b->cap = c;
}
static void sb_add(sb *b, const void *s, size_t n) {
    sb_reserve(b, n);
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void sb_puts(sb *b, const char *s) { sb_add(b, s, strlen(s)); }
static void sb_putc(sb *b, char c) { sb_add(b, &c, 1); }
static void sb_vprintf(sb *b, const char *fmt, va_list ap) {
    va_list aq;
    va_copy(aq, ap);
    int n = vsnprintf(NULL, 0, fmt, aq);
    va_end(aq);
    if (n <= 0) return;
    sb_reserve(b, (size_t)n);
    vsnprintf(b->p + b->n, (size_t)n + 1, fmt, ap);
    b->n += (size_t)n;
}
__attribute__((format(printf, 2, 3))) static void sb_printf(sb *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    sb_vprintf(b, fmt, ap);
    va_end(ap);
}
static const char *sb_str(const sb *b) { return b->p ? b->p : ""; }
static void sb_free(sb *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

static double wall_now(void) { /* time.time() */
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}
static double mono_now(void) { /* the event loop's clock */
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* A whole file into memory (NUL-terminated); -1 with errno set when it cannot be read. */
static int read_file(const char *path, char **out, size_t *len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    sb b = {0};
    char buf[65536];
    for (;;) {
        ssize_t r = read(fd, buf, sizeof buf);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int e = errno;
            close(fd);
            sb_free(&b);
            errno = e;
            return -1;
        }
        if (r == 0) break;
        sb_add(&b, buf, (size_t)r);
    }
    close(fd);
    sb_reserve(&b, 0);
    b.p[b.n] = 0;
    *out = b.p;
    *len = b.n;
    return 0;
}

/* ------------------------------------------------------------------ logging */

enum { L_DEBUG = 10, L_INFO = 20, L_WARNING = 30, L_ERROR = 40 };
static int log_fd = 2;
static int log_verbose;

/* One record in the Python's format, "%(asctime)s imex-standin[%(process)d] %(levelname)s
 * %(message)s" (asctime: local time, milliseconds after a comma), one write() each. */
__attribute__((format(printf, 2, 3))) static void logmsg(int level, const char *fmt, ...) {
    if (level < (log_verbose ? L_DEBUG : L_INFO)) return;
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    struct tm tm;
    localtime_r(&t.tv_sec, &tm);
    char ts[40];
    strftime(ts, sizeof ts, "%Y-%m-%d %H:%M:%S", &tm);
    const char *name = level == L_DEBUG ? "DEBUG" : level == L_INFO ? "INFO"
                     : level == L_WARNING ? "WARNING" : "ERROR";
    sb b = {0};
    sb_printf(&b, "%s,%03ld imex-standin[%d] %s ", ts, t.tv_nsec / 1000000L, (int)getpid(), name);
    va_list ap;
    va_start(ap, fmt);
    sb_vprintf(&b, fmt, ap);
    va_end(ap);
    sb_putc(&b, '\n');
    write_all(log_fd, b.p, b.n);
    sb_free(&b);
}

/* ------------------------------------------------------------------ Python's text rules */
/* Texts are UTF-8 bytes. Where a byte is not UTF-8 (argv, a resolver's answer) it stands
 * for the lone surrogate U+DC80..U+DCFF, as Python's surrogateescape makes it. */

/* The code point at s[*i] (UTF-8, encoded surrogates allowed), advancing *i; a byte that
 * starts no valid sequence gives its surrogateescape code point and advances by one. */
static uint32_t u8_next(const unsigned char *s, size_t n, size_t *i) {
    unsigned c = s[*i];
    if (c < 0x80) {
        (*i)++;
        return c;
    }
    int len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    uint32_t cp = c & (0x7Fu >> len);
    if (!len || *i + (size_t)len > n) goto bad;
    for (int k = 1; k < len; k++) {
        unsigned d = s[*i + (size_t)k];
        if ((d & 0xC0) != 0x80) goto bad;
        cp = cp << 6 | (d & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) goto bad;
    *i += (size_t)len;
    return cp;
bad:
    (*i)++;
    return 0xDC00 + c;
}

static void u8_put(sb *b, uint32_t cp) { /* surrogates too: Python's surrogatepass */
    char o[4];
    if (cp < 0x80) {
        sb_putc(b, (char)cp);
    } else if (cp < 0x800) {
        o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 63));
        sb_add(b, o, 2);
    } else if (cp < 0x10000) {
        o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | (cp >> 6 & 63));
        o[2] = (char)(0x80 | (cp & 63));
        sb_add(b, o, 3);
    } else {
        o[0] = (char)(0xF0 | cp >> 18), o[1] = (char)(0x80 | (cp >> 12 & 63));
        o[2] = (char)(0x80 | (cp >> 6 & 63)), o[3] = (char)(0x80 | (cp & 63));
        sb_add(b, o, 4);
    }
}

/* str.isspace(): what str.strip() and str.split() take away */
static int py_isspace(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
           c == 0x202F || c == 0x205F || c == 0x3000;
}
/* what str.splitlines() ends a line at (\r\n counts once) */
static int py_linebreak(uint32_t c) {
    return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || (c >= 0x1C && c <= 0x1E) ||
           c == 0x85 || c == 0x2028 || c == 0x2029;
}
/* str.isprintable(), as far as it matters here: controls, format characters, separators
 * other than the space, surrogates, private use and the unassigned planes are not. Unicode's
 * full tables are not worth carrying: a lone unassigned code point in the BMP (U+0378)
 * counts as printable here, not in Python, which only a repr() of odd text shows. */
static int py_printable(uint32_t c) {
    if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD) return 0;
    if ((c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) ||
        (c >= 0x205F && c <= 0x206F) || c == 0x3000 || c == 0xFEFF) return 0;
    if ((c >= 0xD800 && c <= 0xF8FF) || (c >= 0xFFF0 && c <= 0xFFFB) || c >= 0xF0000) return 0;
    if (c == 0x61C || c == 0x180E || (c >= 0x1D173 && c <= 0x1D17A)) return 0;
    if ((c >= 0x3134B && c < 0xE0100) || (c > 0xE01EF && c < 0xF0000)) return 0; /* unassigned, tags */
    return 1;
}

/* The lines of text as str.splitlines() cuts them; calls fn(line, len, arg) for each. */
static void py_splitlines(const char *text, size_t n, void (*fn)(const char *, size_t, void *),
                          void *arg) {
    const unsigned char *s = (const unsigned char *)text;
    size_t i = 0, start = 0;
    while (i < n) {
        size_t at = i;
        uint32_t c = u8_next(s, n, &i);
        if (!py_linebreak(c)) continue;
        fn(text + start, at - start, arg);
        if (c == '\r' && i < n && s[i] == '\n') i++;
        start = i;
    }
    if (start < n) fn(text + start, n - start, arg);
}

/* str.strip(): [*b, *b + *len) without the whitespace at either end */
static void py_strip(const char **b, size_t *len) {
    const unsigned char *s = (const unsigned char *)*b;
    size_t n = *len, i = 0;
    while (i < n) {
        size_t j = i;
        if (!py_isspace(u8_next(s, n, &j))) break;
        i = j;
    }
    size_t end = n;
    while (end > i) { /* step back over one code point: its continuation bytes, its lead */
        size_t k = end - 1;
        while (k > i && (s[k] & 0xC0) == 0x80 && end - k < 4) k--;
        size_t j = k;
        uint32_t c = u8_next(s, n, &j);
        if (j != end || !py_isspace(c)) break;
        end = k;
    }
    *b += i;
    *len = end - i;
}

/* repr() of a str */
static void py_repr_str(sb *b, const char *text, size_t n) {
    char q = memchr(text, '\'', n) && !memchr(text, '"', n) ? '"' : '\'';
    const unsigned char *s = (const unsigned char *)text;
    sb_putc(b, q);
    for (size_t i = 0; i < n;) {
        size_t at = i;
        uint32_t c = u8_next(s, n, &i);
        if (c == (uint32_t)q || c == '\\') {
            sb_putc(b, '\\');
            sb_putc(b, (char)c);
        } else if (c == '\t') {
            sb_puts(b, "\\t");
        } else if (c == '\n') {
            sb_puts(b, "\\n");
        } else if (c == '\r') {
            sb_puts(b, "\\r");
        } else if (c < 0x7F && c >= 0x20) {
            sb_putc(b, (char)c);
        } else if (c >= 0x80 && py_printable(c)) {
            sb_add(b, text + at, i - at);
        } else if (c <= 0xFF) {
            sb_printf(b, "\\x%02x", c);
        } else if (c <= 0xFFFF) {
            sb_printf(b, "\\u%04x", c);
        } else {
            sb_printf(b, "\\U%08x", c);
        }
    }
    sb_putc(b, q);
}

/* repr() of a float (shortest round-trip digits; exponent form outside 1e-4 .. 1e16) */
static void py_float_repr(sb *b, double d) {
    if (isnan(d)) { sb_puts(b, "nan"); return; }
    if (isinf(d)) { sb_puts(b, d < 0 ? "-inf" : "inf"); return; }
    char buf[48];
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*e", p - 1, d);
        if (strtod(buf, NULL) == d) break;
    }
    const char *s = buf;
    if (*s == '-') sb_putc(b, *s++);
    char digits[24];
    int nd = 0;
    for (; *s != 'e'; s++)
        if (*s != '.') digits[nd++] = *s;
    int decpt = atoi(s + 1) + 1; /* value = 0.DIGITS x 10^decpt */
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            sb_puts(b, "0.");
            for (int k = 0; k < -decpt; k++) sb_putc(b, '0');
            sb_add(b, digits, (size_t)nd);
        } else if (decpt >= nd) {
            sb_add(b, digits, (size_t)nd);
            for (int k = nd; k < decpt; k++) sb_putc(b, '0');
            sb_puts(b, ".0");
        } else {
            sb_add(b, digits, (size_t)decpt);
            sb_putc(b, '.');
            sb_add(b, digits + decpt, (size_t)(nd - decpt));
        }
    } else {
        sb_putc(b, digits[0]);
        if (nd > 1) {
            sb_putc(b, '.');
            sb_add(b, digits + 1, (size_t)(nd - 1));
        }
        sb_printf(b, "e%c%02d", decpt - 1 < 0 ? '-' : '+', abs(decpt - 1));
    }
}

/* str(OSError): "[Errno N] strerror", with ": 'filename'" when the call named a file */
static void os_error(sb *b, int err, const char *filename) {
    sb_printf(b, "[Errno %d] %s", err, strerror(err));
    if (filename) {
        sb_puts(b, ": ");
        py_repr_str(b, filename, strlen(filename));
    }
}
static const char *errno_text(int err) { /* the same, for a socket (no file name) */
    static char buf[160];
    snprintf(buf, sizeof buf, "[Errno %d] %s", err, strerror(err));
    return buf;
}

/* str(pathlib.Path(p)): slashes collapsed, "." parts dropped, no trailing slash */
static char *py_path(const char *p) {
    sb b = {0};
    if (p[0] == '/') sb_puts(&b, p[1] == '/' && p[2] != '/' ? "//" : "/");
    size_t root = b.n;
    for (const char *s = p; *s;) {
        while (*s == '/') s++;
        const char *e = strchrnul(s, '/');
        size_t n = (size_t)(e - s);
        if (n && !(n == 1 && *s == '.')) {
            if (b.n > root) sb_putc(&b, '/');
            sb_add(&b, s, n);
        }
        s = e;
    }
    if (!b.n) sb_putc(&b, '.');
    return b.p;
}

/* The attempt log's outcome of a failed dial or link, by the OSError subclass Python makes
 * of the errno (0: no errno, a plain ConnectionError or ValueError). */
static const char *outcome_of(int err) {
    if (err == ECONNREFUSED) return "refused";
    if (err == ETIMEDOUT) return "timeout";
    if (err == EHOSTUNREACH || err == ENETUNREACH) return "unreachable";
    return "error";
}

/* ------------------------------------------------------------------ SHA-256 (nodes_hash) */

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) ((x) >> (n) | (x) << (32 - (n)))

static void sha256_block(uint32_t h[8], const unsigned char *p) {
    uint32_t w[64], v[8];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ w[i - 15] >> 3;
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ w[i - 2] >> 10;
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    memcpy(v, h, sizeof v);
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = v[7] + (ROR(v[4], 6) ^ ROR(v[4], 11) ^ ROR(v[4], 25)) +
                      ((v[4] & v[5]) ^ (~v[4] & v[6])) + K256[i] + w[i];
        uint32_t t2 = (ROR(v[0], 2) ^ ROR(v[0], 13) ^ ROR(v[0], 22)) +
                      ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
        memmove(v + 1, v, 7 * sizeof *v);
        v[4] += t1;
        v[0] = t1 + t2;
    }
    for (int i = 0; i < 8; i++) h[i] += v[i];
}

/* hashlib.sha256(data).hexdigest() */
static void sha256_hex(const void *data, size_t n, char out[65]) {
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    const unsigned char *p = data;
    size_t left = n;
    for (; left >= 64; left -= 64, p += 64) sha256_block(h, p);
    unsigned char tail[128] = {0};
    memcpy(tail, p, left);
    tail[left] = 0x80;
    size_t tn = left < 56 ? 64 : 128;
    uint64_t bits = (uint64_t)n * 8;
    for (int i = 0; i < 8; i++) tail[tn - 1 - i] = (unsigned char)(bits >> (8 * i));
    sha256_block(h, tail);
    if (tn == 128) sha256_block(h, tail + 64);
    for (int i = 0; i < 8; i++) snprintf(out + 8 * i, 9, "%08x", h[i]);
}

/* ------------------------------------------------------------------ JSON values */
/* A small DOM: what a peer's or the ctl's line parses into, and what the replies, the
 * state file and the attempt log are built from before json_dump writes them with
 * json.dumps's rules (ensure_ascii, the separators, sort_keys for the state file). */

enum { J_NULL, J_FALSE, J_TRUE, J_INT, J_FLOAT, J_STR, J_ARR, J_OBJ, J_RAW };

typedef struct jv jv;
struct jv {
    int t;
    char *s;     /* J_STR: its text (UTF-8); J_INT: its digits when too big; J_RAW: JSON */
    size_t n;
    long long i; /* J_INT */
    int big;     /* J_INT beyond long long: s holds the digits */
    double d;    /* J_FLOAT */
    jv **v;      /* J_ARR items, J_OBJ values */
    char **k;    /* J_OBJ keys, in insertion order (a dict's) */
    size_t *kn;
    size_t len, cap;
};

static jv *jnew(int t) {
    jv *v = xcalloc(sizeof *v);
    v->t = t;
    return v;
}
static jv *jstrn(const char *s, size_t n) {
    jv *v = jnew(J_STR);
    v->s = xstrndup(s, n);
    v->n = n;
    return v;
}
static jv *jstr(const char *s) { return jstrn(s, strlen(s)); }
static jv *jstr_or_null(const char *s) { return s ? jstr(s) : jnew(J_NULL); }
static jv *jint(long long i) {
    jv *v = jnew(J_INT);
    v->i = i;
    return v;
}
static jv *jfloat(double d) {
    jv *v = jnew(J_FLOAT);
    v->d = d;
    return v;
}
static jv *jbool(int b) { return jnew(b ? J_TRUE : J_FALSE); }
static jv *jraw(const char *s) { /* JSON text already written: put in as it is */
    jv *v = jstr(s);
    v->t = J_RAW;
    return v;
}

static void jfree(jv *v) {
    if (!v) return;
    for (size_t i = 0; i < v->len; i++) {
        jfree(v->v[i]);
        if (v->k) free(v->k[i]);
    }
    free(v->v);
    free(v->k);
    free(v->kn);
    free(v->s);
    free(v);
}

static void jgrow(jv *c) {
    if (c->len < c->cap) return;
    c->cap = c->cap ? 2 * c->cap : 8;
    c->v = xrealloc(c->v, c->cap * sizeof *c->v);
    if (c->t == J_OBJ) {
        c->k = xrealloc(c->k, c->cap * sizeof *c->k);
        c->kn = xrealloc(c->kn, c->cap * sizeof *c->kn);
    }
}
static void jpush(jv *a, jv *x) {
    jgrow(a);
    a->v[a->len++] = x;
}
/* o[key] = x, as a dict does it: a key seen before keeps its place and takes the new value */
static void jputn(jv *o, const char *key, size_t kn, jv *x) {
    for (size_t i = 0; i < o->len; i++)
        if (o->kn[i] == kn && !memcmp(o->k[i], key, kn)) {
            jfree(o->v[i]);
            o->v[i] = x;
            return;
        }
    jgrow(o);
    o->k[o->len] = xstrndup(key, kn);
    o->kn[o->len] = kn;
    o->v[o->len++] = x;
}
static void jput(jv *o, const char *key, jv *x) { jputn(o, key, strlen(key), x); }
static jv *jget(const jv *o, const char *key) { /* o.get(key): NULL for None-or-missing */
    if (!o || o->t != J_OBJ) return NULL;
    size_t kn = strlen(key);
    for (size_t i = 0; i < o->len; i++)
        if (o->kn[i] == kn && !memcmp(o->k[i], key, kn)) return o->v[i];
    return NULL;
}
static int jis_str(const jv *v, const char *s) {
    return v && v->t == J_STR && v->n == strlen(s) && !memcmp(v->s, s, v->n);
}
/* value == n, as Python compares: 1 == 1.0 == True */
static int jeq_int(const jv *v, long long n) {
    if (!v) return 0;
    if (v->t == J_INT) return !v->big && v->i == n;
    if (v->t == J_FLOAT) return v->d == (double)n;
    if (v->t == J_TRUE) return n == 1;
    if (v->t == J_FALSE) return n == 0;
    return 0;
}

/* ---- writing: json.dumps */

/* a str as json.dumps writes it with ensure_ascii */
static void json_str(sb *b, const char *text, size_t n) {
    const unsigned char *s = (const unsigned char *)text;
    sb_putc(b, '"');
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && s[j] >= ' ' && s[j] <= '~' && s[j] != '\\' && s[j] != '"') j++;
        if (j > i) {
            sb_add(b, s + i, j - i);
            i = j;
            continue;
        }
        uint32_t c = u8_next(s, n, &i);
        switch (c) {
        case '\\': sb_puts(b, "\\\\"); break;
        case '"': sb_puts(b, "\\\""); break;
        case '\b': sb_puts(b, "\\b"); break;
        case '\f': sb_puts(b, "\\f"); break;
        case '\n': sb_puts(b, "\\n"); break;
        case '\r': sb_puts(b, "\\r"); break;
        case '\t': sb_puts(b, "\\t"); break;
        default:
            if (c >= 0x10000) {
                c -= 0x10000;
                sb_printf(b, "\\u%04x\\u%04x", 0xD800 | (c >> 10), 0xDC00 | (c & 0x3FF));
            } else {
                sb_printf(b, "\\u%04x", c);
            }
        }
    }
    sb_putc(b, '"');
}

static int key_cmp(const jv *o, size_t a, size_t b) { /* str order = UTF-8 byte order */
    size_t n = o->kn[a] < o->kn[b] ? o->kn[a] : o->kn[b];
    int c = memcmp(o->k[a], o->k[b], n);
    return c ? c : (o->kn[a] > o->kn[b]) - (o->kn[a] < o->kn[b]);
}

/* json.dumps(v): compact is separators=(",", ":"), else the default ", " and ": " */
static void json_dump(sb *b, const jv *v, int sort, int compact) {
    const char *isep = compact ? "," : ", ", *ksep = compact ? ":" : ": ";
    switch (v->t) {
    case J_NULL: sb_puts(b, "null"); break;
    case J_TRUE: sb_puts(b, "true"); break;
    case J_FALSE: sb_puts(b, "false"); break;
    case J_INT:
        if (v->big) sb_add(b, v->s, v->n);
        else sb_printf(b, "%lld", v->i);
        break;
    case J_FLOAT:
        if (isnan(v->d)) sb_puts(b, "NaN");
        else if (isinf(v->d)) sb_puts(b, v->d < 0 ? "-Infinity" : "Infinity");
        else py_float_repr(b, v->d);
        break;
    case J_STR: json_str(b, v->s, v->n); break;
    case J_RAW: sb_add(b, v->s, v->n); break;
    case J_ARR:
        sb_putc(b, '[');
        for (size_t i = 0; i < v->len; i++) {
            if (i) sb_puts(b, isep);
            json_dump(b, v->v[i], sort, compact);
        }
        sb_putc(b, ']');
        break;
    case J_OBJ: {
        size_t *order = xmalloc((v->len + 1) * sizeof *order);
        for (size_t i = 0; i < v->len; i++) { /* insertion sort: objects here are small */
            size_t j = i;
            while (sort && j > 0 && key_cmp(v, order[j - 1], i) > 0) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = i;
        }
        sb_putc(b, '{');
        for (size_t i = 0; i < v->len; i++) {
            if (i) sb_puts(b, isep);
            json_str(b, v->k[order[i]], v->kn[order[i]]);
            sb_puts(b, ksep);
            json_dump(b, v->v[order[i]], sort, compact);
        }
        sb_putc(b, '}');
        free(order);
        break;
    }
    }
}

/* ---- str() and repr() of a parsed value (the log lines and errors that show one) */

static void py_repr_jv(sb *b, const jv *v) {
    if (!v) { sb_puts(b, "None"); return; }
    switch (v->t) {
    case J_NULL: sb_puts(b, "None"); break;
    case J_TRUE: sb_puts(b, "True"); break;
    case J_FALSE: sb_puts(b, "False"); break;
    case J_INT:
        if (v->big) sb_add(b, v->s, v->n);
        else sb_printf(b, "%lld", v->i);
        break;
    case J_FLOAT: py_float_repr(b, v->d); break;
    case J_STR: py_repr_str(b, v->s, v->n); break;
    case J_RAW: sb_add(b, v->s, v->n); break;
    case J_ARR:
        sb_putc(b, '[');
        for (size_t i = 0; i < v->len; i++) {
            if (i) sb_puts(b, ", ");
            py_repr_jv(b, v->v[i]);
        }
        sb_putc(b, ']');
        break;
    case J_OBJ:
        sb_putc(b, '{');
        for (size_t i = 0; i < v->len; i++) {
            if (i) sb_puts(b, ", ");
            py_repr_str(b, v->k[i], v->kn[i]);
            sb_puts(b, ": ");
            py_repr_jv(b, v->v[i]);
        }
        sb_putc(b, '}');
        break;
    }
}
static void py_str_jv(sb *b, const jv *v) {
    if (v && v->t == J_STR) sb_add(b, v->s, v->n);
    else py_repr_jv(b, v);
}

/* ---- reading: json.loads, error texts included */
/* Python 3.11's scanner (Modules/_json.c) step by step, over UTF-8 bytes: every position it
 * can stop at is a character's first byte, and a message counts characters, as Python's
 * JSONDecodeError does ("Expecting value: line 1 column 1 (char 0)"). */

typedef struct {
    const unsigned char *s;
    size_t n;
    sb *err;
    int depth;
} jparse;

static void jp_error(jparse *p, const char *msg, size_t pos) {
    size_t chars = 0, line = 1, nl = 0;
    int seen_nl = 0;
    for (size_t i = 0; i < pos && i < p->n; i++) {
        if ((p->s[i] & 0xC0) == 0x80) continue;
        if (p->s[i] == '\n') line++, nl = chars, seen_nl = 1;
        chars++;
    }
    size_t col = seen_nl ? chars - nl : chars + 1;
    sb_printf(p->err, "%s: line %zu column %zu (char %zu)", msg, line, col, chars);
}

static int jp_ws_char(unsigned c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static size_t jp_ws(const jparse *p, size_t i) {
    while (i < p->n && jp_ws_char(p->s[i])) i++;
    return i;
}
static int is_digit(unsigned c) { return c >= '0' && c <= '9'; }
static int hex4(const unsigned char *s, uint32_t *out) {
    uint32_t c = 0;
    for (int i = 0; i < 4; i++) {
        unsigned d = s[i];
        c <<= 4;
        if (is_digit(d)) c |= d - '0';
        else if (d >= 'a' && d <= 'f') c |= d - 'a' + 10;
        else if (d >= 'A' && d <= 'F') c |= d - 'A' + 10;
        else return 0;
    }
    *out = c;
    return 1;
}

static jv *jp_value(jparse *p, size_t idx, size_t *next);

/* scanstring_unicode: end is the index after the opening quote */
static jv *jp_string(jparse *p, size_t end, size_t *next) {
    const unsigned char *s = p->s;
    size_t n = p->n, begin = end - 1;
    sb out = {0};
    for (;;) {
        size_t i = end;
        unsigned c = 0;
        for (; i < n; i++) {
            c = s[i];
            if (c == '"' || c == '\\') break;
            if (c <= 0x1F) {
                jp_error(p, "Invalid control character at", i);
                goto bail;
            }
        }
        if (i >= n) {
            jp_error(p, "Unterminated string starting at", begin);
            goto bail;
        }
        sb_add(&out, s + end, i - end);
        i++;
        if (c == '"') {
            end = i;
            break;
        }
        if (i == n) {
            jp_error(p, "Unterminated string starting at", begin);
            goto bail;
        }
        uint32_t cp;
        c = s[i];
        if (c != 'u') {
            end = i + 1;
            switch (c) {
            case '"': case '\\': case '/': cp = c; break;
            case 'b': cp = '\b'; break;
            case 'f': cp = '\f'; break;
            case 'n': cp = '\n'; break;
            case 'r': cp = '\r'; break;
            case 't': cp = '\t'; break;
            default:
                jp_error(p, "Invalid \\escape", end - 2);
                goto bail;
            }
        } else {
            i++;
            end = i + 4;
            if (end >= n || !hex4(s + i, &cp)) {
                jp_error(p, "Invalid \\uXXXX escape", i - 1);
                goto bail;
            }
            /* a high surrogate and an escaped low one make one character */
            if (cp >= 0xD800 && cp <= 0xDBFF && end + 6 < n && s[end] == '\\' && s[end + 1] == 'u') {
                uint32_t c2;
                if (!hex4(s + end + 2, &c2)) {
                    jp_error(p, "Invalid \\uXXXX escape", end + 1);
                    goto bail;
                }
                if (c2 >= 0xDC00 && c2 <= 0xDFFF) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (c2 - 0xDC00);
                    end += 6;
                }
            }
        }
        u8_put(&out, cp);
    }
    *next = end;
    jv *v = jnew(J_STR);
    v->s = out.p ? out.p : xstrdup("");
    v->n = out.n;
    return v;
bail:
    sb_free(&out);
    return NULL;
}

static jv *jp_object(jparse *p, size_t idx, size_t *next) {
    const unsigned char *s = p->s;
    size_t n = p->n, nx;
    jv *o = jnew(J_OBJ);
    idx = jp_ws(p, idx);
    if (idx >= n || s[idx] != '}') {
        for (;;) {
            if (idx >= n || s[idx] != '"') {
                jp_error(p, "Expecting property name enclosed in double quotes", idx);
                goto bail;
            }
            jv *key = jp_string(p, idx + 1, &nx);
            if (!key) goto bail;
            idx = jp_ws(p, nx);
            if (idx >= n || s[idx] != ':') {
                jfree(key);
                jp_error(p, "Expecting ':' delimiter", idx);
                goto bail;
            }
            idx = jp_ws(p, idx + 1);
            jv *val = jp_value(p, idx, &nx);
            if (!val) {
                jfree(key);
                goto bail;
            }
            jputn(o, key->s, key->n, val);
            jfree(key);
            idx = jp_ws(p, nx);
            if (idx < n && s[idx] == '}') break;
            if (idx >= n || s[idx] != ',') {
                jp_error(p, "Expecting ',' delimiter", idx);
                goto bail;
            }
            idx = jp_ws(p, idx + 1);
        }
    }
    *next = idx + 1;
    return o;
bail:
    jfree(o);
    return NULL;
}

static jv *jp_array(jparse *p, size_t idx, size_t *next) {
    const unsigned char *s = p->s;
    size_t n = p->n, nx;
    jv *a = jnew(J_ARR);
    idx = jp_ws(p, idx);
    if (idx >= n || s[idx] != ']') {
        for (;;) {
            jv *val = jp_value(p, idx, &nx);
            if (!val) goto bail;
            jpush(a, val);
            idx = jp_ws(p, nx);
            if (idx < n && s[idx] == ']') break;
            if (idx >= n || s[idx] != ',') {
                jp_error(p, "Expecting ',' delimiter", idx);
                goto bail;
            }
            idx = jp_ws(p, idx + 1);
        }
    }
    *next = idx + 1;
    return a;
bail:
    jfree(a);
    return NULL;
}

/* _match_number_unicode; a start that is no number is "Expecting value" (StopIteration) */
static jv *jp_number(jparse *p, size_t start, size_t *next) {
    const unsigned char *s = p->s;
    size_t idx = start, last = p->n - 1;
    int is_float = 0;
    if (s[idx] == '-' && ++idx > last) goto stop;
    if (s[idx] >= '1' && s[idx] <= '9') {
        idx++;
        while (idx <= last && is_digit(s[idx])) idx++;
    } else if (s[idx] == '0') {
        idx++;
    } else {
        goto stop;
    }
    if (idx < last && s[idx] == '.' && is_digit(s[idx + 1])) {
        is_float = 1;
        idx += 2;
        while (idx <= last && is_digit(s[idx])) idx++;
    }
    if (idx < last && (s[idx] == 'e' || s[idx] == 'E')) {
        size_t e_start = idx++;
        if (idx < last && (s[idx] == '-' || s[idx] == '+')) idx++;
        while (idx <= last && is_digit(s[idx])) idx++;
        if (is_digit(s[idx - 1])) is_float = 1;
        else idx = e_start;
    }
    *next = idx;
    char *text = xstrndup((const char *)s + start, idx - start);
    jv *v;
    if (is_float) {
        v = jfloat(strtod(text, NULL));
    } else if (idx - start - (s[start] == '-') > INT_MAX_STR_DIGITS) {
        sb_printf(p->err, "Exceeds the limit (%d digits) for integer string conversion: value has "
                  "%zu digits; use sys.set_int_max_str_digits() to increase the limit",
                  INT_MAX_STR_DIGITS, idx - start - (s[start] == '-'));
        v = NULL;
    } else {
        v = jnew(J_INT);
        errno = 0;
        v->i = strtoll(text, NULL, 10);
        if (errno == ERANGE) {
            v->big = 1;
            v->s = xstrdup(text);
            v->n = strlen(text);
        }
    }
    free(text);
    return v;
stop:
    jp_error(p, "Expecting value", start);
    return NULL;
}

static int jp_word(const jparse *p, size_t idx, const char *w) {
    size_t n = strlen(w);
    return idx + n < p->n && !memcmp(p->s + idx + 1, w, n);
}

/* scan_once_unicode */
static jv *jp_value(jparse *p, size_t idx, size_t *next) {
    if (idx >= p->n) {
        jp_error(p, "Expecting value", idx);
        return NULL;
    }
    switch (p->s[idx]) {
    case '"':
        return jp_string(p, idx + 1, next);
    case '{':
    case '[': {
        int obj = p->s[idx] == '{';
        if (p->depth >= JSON_MAX_DEPTH) {
            sb_printf(p->err, "maximum recursion depth exceeded while decoding a JSON %s from a "
                      "unicode string", obj ? "object" : "array");
            return NULL;
        }
        p->depth++;
        jv *v = obj ? jp_object(p, idx + 1, next) : jp_array(p, idx + 1, next);
        p->depth--;
        return v;
    }
    case 'n':
        if (jp_word(p, idx, "ull")) { *next = idx + 4; return jnew(J_NULL); }
        break;
    case 't':
        if (jp_word(p, idx, "rue")) { *next = idx + 4; return jnew(J_TRUE); }
        break;
    case 'f':
        if (jp_word(p, idx, "alse")) { *next = idx + 5; return jnew(J_FALSE); }
        break;
    case 'N':
        if (jp_word(p, idx, "aN")) { *next = idx + 3; return jfloat(NAN); }
        break;
    case 'I':
        if (jp_word(p, idx, "nfinity")) { *next = idx + 8; return jfloat(INFINITY); }
        break;
    case '-':
        if (jp_word(p, idx, "Infinity")) { *next = idx + 9; return jfloat(-INFINITY); }
        break;
    }
    return jp_number(p, idx, next);
}

/* str(UnicodeDecodeError) */
static int decode_error(sb *err, const char *codec, const unsigned char *s, size_t start,
                        size_t end, const char *why) {
    if (end == start + 1)
        sb_printf(err, "'%s' codec can't decode byte 0x%02x in position %zu: %s", codec, s[start],
                  start, why);
    else
        sb_printf(err, "'%s' codec can't decode bytes in position %zu-%zu: %s", codec, start,
                  end - 1, why);
    return -1;
}

/* bytes.decode("utf-8", "surrogatepass") would succeed: 0, else -1 and its error's text */
static int utf8_check(const unsigned char *s, size_t n, int surrogates, sb *err) {
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t need;
        unsigned lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) {
            need = 1;
        } else if (c >= 0xE0 && c <= 0xEF) {
            need = 2;
            lo = c == 0xE0 ? 0xA0 : 0x80;
            hi = c == 0xED ? 0x9F : 0xBF;
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            lo = c == 0xF0 ? 0x90 : 0x80;
            hi = c == 0xF4 ? 0x8F : 0xBF;
        } else {
            return decode_error(err, "utf-8", s, i, i + 1, "invalid start byte");
        }
        if (surrogates && c == 0xED && i + 2 < n && s[i + 1] >= 0xA0 && s[i + 1] <= 0xBF &&
            (s[i + 2] & 0xC0) == 0x80) {
            i += 3; /* an encoded surrogate: surrogatepass takes it */
            continue;
        }
        for (size_t k = 1; k <= need; k++) {
            if (i + k >= n) return decode_error(err, "utf-8", s, i, n, "unexpected end of data");
            unsigned d = s[i + k], l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
            if (d < l || d > h) return decode_error(err, "utf-8", s, i, i + k, "invalid continuation byte");
        }
        i += need + 1;
    }
    return 0;
}

/* json.detect_encoding */
static const char *detect_encoding(const unsigned char *b, size_t n) {
    if (n >= 4 && ((!b[0] && !b[1] && b[2] == 0xFE && b[3] == 0xFF) ||
                   (b[0] == 0xFF && b[1] == 0xFE && !b[2] && !b[3]))) return "utf-32";
    if (n >= 2 && ((b[0] == 0xFE && b[1] == 0xFF) || (b[0] == 0xFF && b[1] == 0xFE))) return "utf-16";
    if (n >= 3 && b[0] == 0xEF && b[1] == 0xBB && b[2] == 0xBF) return "utf-8-sig";
    if (n >= 4) {
        if (!b[0]) return b[1] ? "utf-16-be" : "utf-32-be";
        if (!b[1]) return b[2] || b[3] ? "utf-16-le" : "utf-32-le";
    } else if (n == 2) {
        if (!b[0]) return "utf-16-be";
        if (!b[1]) return "utf-16-le";
    }
    return "utf-8";
}

/* A UTF-16 or UTF-32 line (a peer would never send one; Python would still read it) as
 * UTF-8 into doc: 0, or -1 with the decoder's error. */
static int decode_wide(const unsigned char *b, size_t n, const char *enc, sb *doc, sb *err) {
    size_t w = strstr(enc, "32") ? 4 : 2, i = 0;
    int be = strstr(enc, "-be") != NULL;
    if (!strchr(enc + 4, '-')) { /* "utf-16" / "utf-32": the BOM says the order */
        be = b[0] == 0 || b[0] == 0xFE;
        i = w;
    }
    for (; i + w <= n; i += w) {
        uint32_t c = 0;
        for (size_t k = 0; k < w; k++) c |= (uint32_t)b[i + (be ? k : w - 1 - k)] << (8 * (w - 1 - k));
        if (w == 2 && c >= 0xD800 && c <= 0xDBFF && i + 4 <= n) {
            uint32_t c2 = be ? (uint32_t)b[i + 2] << 8 | b[i + 3] : (uint32_t)b[i + 3] << 8 | b[i + 2];
            if (c2 >= 0xDC00 && c2 <= 0xDFFF) {
                c = 0x10000 + ((c - 0xD800) << 10) + (c2 - 0xDC00);
                i += 2;
            }
        }
        if (c > 0x10FFFF) {
            char codec[16];
            snprintf(codec, sizeof codec, "%s", enc);
            return decode_error(err, codec, b, i, i + 4, "code point not in range(0x110000)");
        }
        u8_put(doc, c);
    }
    if (i < n) return decode_error(err, enc, b, i, n, "truncated data");
    return 0;
}

/* json.loads(data) where data is bytes: the DOM, or NULL and str() of Python's exception */
static jv *json_loads(const char *data, size_t n, sb *err) {
    const unsigned char *b = (const unsigned char *)data;
    const char *enc = detect_encoding(b, n);
    sb wide = {0};
    jv *v = NULL;
    if (!strncmp(enc, "utf-8", 5)) {
        if (enc[5]) b += 3, n -= 3; /* utf-8-sig: the BOM goes */
        if (utf8_check(b, n, 1, err)) return NULL;
    } else {
        if (decode_wide(b, n, enc, &wide, err)) goto out;
        b = (const unsigned char *)sb_str(&wide);
        n = wide.n;
    }
    jparse p = {b, n, err, 0};
    size_t next;
    v = jp_value(&p, jp_ws(&p, 0), &next);
    if (v && jp_ws(&p, next) != n) {
        jp_error(&p, "Extra data", jp_ws(&p, next));
        jfree(v);
        v = NULL;
    }
out:
    sb_free(&wide);
    return v;
}

/* _parse_json_line for a whole line (it ends with "\n"): an object, or NULL and why not */
static jv *json_line(const char *line, size_t n, sb *err) {
    jv *v = json_loads(line, n, err);
    if (v && v->t != J_OBJ) {
        jfree(v);
        v = NULL;
        sb_puts(err, "not a JSON object");
    }
    return v;
}

/* ------------------------------------------------------------------ addresses */

/* str(ipaddress.ip_address(text)) into out, or 0 when text is not an IP address. IPv6 in
 * ipaddress's compressed form (which, unlike inet_ntop, never writes a dotted quad), with
 * a "%scope" kept as ipaddress keeps it. */
static int py_ip_normalize(const char *text, char *out, size_t outlen) {
    struct in_addr a4;
    if (inet_pton(AF_INET, text, &a4) == 1) return inet_ntop(AF_INET, &a4, out, (socklen_t)outlen) != NULL;
    const char *pct = strchr(text, '%');
    char addr[INET6_ADDRSTRLEN + 8];
    size_t alen = pct ? (size_t)(pct - text) : strlen(text);
    if (alen >= sizeof addr) return 0;
    memcpy(addr, text, alen);
    addr[alen] = 0;
    if (pct && (!pct[1] || strchr(pct + 1, '%'))) return 0;
    unsigned char a6[16];
    if (inet_pton(AF_INET6, addr, a6) != 1) return 0;
    unsigned h[8];
    for (int i = 0; i < 8; i++) h[i] = (unsigned)a6[2 * i] << 8 | a6[2 * i + 1];
    int best = -1, best_len = 0; /* the longest run of zero groups (first of equals), 2+ */
    for (int i = 0; i < 8;) {
        if (h[i]) { i++; continue; }
        int j = i;
        while (j < 8 && !h[j]) j++;
        if (j - i > best_len && j - i > 1) best = i, best_len = j - i;
        i = j;
    }
    sb b = {0};
    for (int i = 0; i < 8; i++) {
        if (i == best) {
            sb_puts(&b, "::");
            i += best_len - 1;
            continue;
        }
        if (i && !(best >= 0 && i == best + best_len)) sb_putc(&b, ':');
        sb_printf(&b, "%x", h[i]);
    }
    if (pct) sb_puts(&b, pct);
    int ok = b.n < outlen;
    if (ok) memcpy(out, b.p, b.n + 1);
    sb_free(&b);
    return ok;
}

/* the text Python's socket module gives a resolver's address (inet_ntop, no scope) */
static void sockaddr_text(const struct sockaddr *sa, char *out, size_t outlen) {
    const void *a = sa->sa_family == AF_INET6 ? (const void *)&((const struct sockaddr_in6 *)sa)->sin6_addr
                                              : (const void *)&((const struct sockaddr_in *)sa)->sin_addr;
    if (!inet_ntop(sa->sa_family, a, out, (socklen_t)outlen)) snprintf(out, outlen, "?");
}

/* str(socket.gaierror) and friends for a getaddrinfo failure */
static void gai_error_text(sb *b, int code, int err) {
    if (code == EAI_SYSTEM) os_error(b, err ? err : EIO, NULL);
    else sb_printf(b, "[Errno %d] %s", code, gai_strerror(code));
}

/* Python hands a name to getaddrinfo through the "idna" codec; for an ASCII name that
 * refuses an empty label or one of 64+ characters (UnicodeError). 1 with the text. */
static int idna_refuses(const char *host, sb *why) {
    for (const unsigned char *c = (const unsigned char *)host; *c; c++)
        if (*c >= 0x80) return 0; /* non-ASCII: nameprep, punycode; not reproduced */
    if (!*host) return 0;
    const char *s = host;
    for (;;) {
        const char *dot = strchr(s, '.');
        size_t n = dot ? (size_t)(dot - s) : strlen(s);
        if (dot && (n == 0 || n >= 64)) {
            sb_puts(why, "encoding with 'idna' codec failed (UnicodeError: label empty or too long)");
            return 1;
        }
        if (!dot) {
            if (n >= 64) {
                sb_puts(why, "encoding with 'idna' codec failed (UnicodeError: label too long)");
                return 1;
            }
            return 0;
        }
        s = dot + 1;
    }
}

/* A list of address texts (a name's resolution, in the resolver's order, no repeats). */
typedef struct { char **a; int n; } addrs_t;

static void addrs_add(addrs_t *l, const char *ip) {
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->a[i], ip)) return;
    l->a = xrealloc(l->a, (size_t)(l->n + 1) * sizeof *l->a);
    l->a[l->n++] = xstrdup(ip);
}
static void addrs_free(addrs_t *l) {
    for (int i = 0; i < l->n; i++) free(l->a[i]);
    free(l->a);
    memset(l, 0, sizeof *l);
}
static void addrs_from_ai(addrs_t *l, const struct addrinfo *ai) {
    char ip[INET6_ADDRSTRLEN];
    for (; ai; ai = ai->ai_next) {
        if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6) continue;
        sockaddr_text(ai->ai_addr, ip, sizeof ip);
        addrs_add(l, ip);
    }
}

/* ------------------------------------------------------------------ /etc/hosts (HostsFile) */
/* glibc's "files" source as getaddrinfo answers it: every address of every line naming the
 * host (canonical name or alias, any case), in file order. Parsed again only when the file
 * changed (inode, device, size, mtime, ctime): a SIGUSR1 re-resolves every peer, and a C++
 * daemon does not read the file 17 times for it. */

typedef struct { char *name; addrs_t ips; } hosts_name;

static struct {
    int parsed;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime, ctime;
    hosts_name *names;
    int n;
} hosts;

static hosts_name *hosts_find(const char *key) {
    for (int i = 0; i < hosts.n; i++)
        if (!strcmp(hosts.names[i].name, key)) return &hosts.names[i];
    return NULL;
}

/* a name as the table keys it: lower case, trailing dots gone */
static char *hosts_key(const char *name, size_t n) {
    char *k = xstrndup(name, n);
    for (char *c = k; *c; c++)
        if (*c >= 'A' && *c <= 'Z') *c = (char)(*c - 'A' + 'a');
    size_t len = strlen(k);
    while (len && k[len - 1] == '.') k[--len] = 0;
    return k;
}

static void hosts_line(const char *line, size_t n, void *arg) {
    (void)arg;
    const char *hash = memchr(line, '#', n);
    if (hash) n = (size_t)(hash - line);
    const unsigned char *s = (const unsigned char *)line;
    char *fields[64];
    int nf = 0;
    for (size_t i = 0; i < n && nf < 64;) { /* str.split() */
        size_t j = i;
        if (py_isspace(u8_next(s, n, &j))) {
            i = j;
            continue;
        }
        size_t start = i;
        while (i < n) {
            j = i;
            if (py_isspace(u8_next(s, n, &j))) break;
            i = j;
        }
        fields[nf++] = xstrndup(line + start, i - start);
    }
    char ip[INET6_ADDRSTRLEN + 64];
    if (nf >= 2) {
        char *pct = strchr(fields[0], '%');
        if (pct) *pct = 0;
        if (py_ip_normalize(fields[0], ip, sizeof ip)) {
            for (int f = 1; f < nf; f++) {
                char *key = hosts_key(fields[f], strlen(fields[f]));
                hosts_name *h = hosts_find(key);
                if (!h) {
                    hosts.names = xrealloc(hosts.names, (size_t)(hosts.n + 1) * sizeof *hosts.names);
                    h = &hosts.names[hosts.n++];
                    memset(h, 0, sizeof *h);
                    h->name = key;
                } else {
                    free(key);
                }
                addrs_add(&h->ips, ip);
            }
        }
    }
    for (int f = 0; f < nf; f++) free(fields[f]);
}

/* The addresses /etc/hosts gives host (an IP literal is itself); 0 when the file does not
 * name it: then the system resolver (DNS) is asked, as "hosts: files dns" does. */
static int hosts_lookup(const char *host, addrs_t *out) {
    char ip[INET6_ADDRSTRLEN + 64];
    if (py_ip_normalize(host, ip, sizeof ip)) {
        addrs_add(out, ip);
        return 1;
    }
    struct stat st;
    if (stat("/etc/hosts", &st) != 0) return 0;
    if (!hosts.parsed || st.st_dev != hosts.dev || st.st_ino != hosts.ino || st.st_size != hosts.size ||
        st.st_mtim.tv_sec != hosts.mtime.tv_sec || st.st_mtim.tv_nsec != hosts.mtime.tv_nsec ||
        st.st_ctim.tv_sec != hosts.ctime.tv_sec || st.st_ctim.tv_nsec != hosts.ctime.tv_nsec) {
        char *text;
        size_t len;
        if (read_file("/etc/hosts", &text, &len) != 0) return 0;
        for (int i = 0; i < hosts.n; i++) {
            free(hosts.names[i].name);
            addrs_free(&hosts.names[i].ips);
        }
        free(hosts.names);
        hosts.names = NULL;
        hosts.n = 0;
        py_splitlines(text, len, hosts_line, NULL);
        free(text);
        hosts.parsed = 1;
        hosts.dev = st.st_dev, hosts.ino = st.st_ino, hosts.size = st.st_size;
        hosts.mtime = st.st_mtim, hosts.ctime = st.st_ctim;
    }
    char *key = hosts_key(host, strlen(host));
    hosts_name *h = hosts_find(key);
    free(key);
    if (!h) return 0;
    for (int i = 0; i < h->ips.n; i++) addrs_add(out, h->ips.a[i]);
    return 1;
}

/* ------------------------------------------------------------------ config.cfg */

typedef struct {
    int server_port;
    char *node_config_file; /* str(Path) */
    char *bind_ip;          /* normalised, "" for none */
    int cmd_enabled;
    int cmd_port;
    char *cmd_ip;
    char *log_file;
    int daemonize;
} config;

typedef struct { char **k, **v; int n; sb err; int line; } kv_parse;

static void config_line(const char *line, size_t n, void *arg) {
    kv_parse *kv = arg;
    kv->line++;
    if (kv->err.n) return;
    py_strip(&line, &n);
    if (!n || line[0] == '#') return;
    const char *eq = memchr(line, '=', n);
    if (!eq) {
        sb_printf(&kv->err, "line %d: ", kv->line);
        py_repr_str(&kv->err, line, n);
        sb_puts(&kv->err, " is not KEY=VALUE");
        return;
    }
    const char *k = line, *v = eq + 1;
    size_t kn = (size_t)(eq - line), vn = n - kn - 1;
    py_strip(&k, &kn);
    py_strip(&v, &vn);
    for (int i = 0; i < kv->n; i++)
        if (strlen(kv->k[i]) == kn && !memcmp(kv->k[i], k, kn)) {
            free(kv->v[i]);
            kv->v[i] = xstrndup(v, vn);
            return;
        }
    kv->k = xrealloc(kv->k, (size_t)(kv->n + 1) * sizeof *kv->k);
    kv->v = xrealloc(kv->v, (size_t)(kv->n + 1) * sizeof *kv->v);
    kv->k[kv->n] = xstrndup(k, kn);
    kv->v[kv->n++] = xstrndup(v, vn);
}

static const char *kv_get(const kv_parse *kv, const char *key) {
    for (int i = 0; i < kv->n; i++)
        if (!strcmp(kv->k[i], key)) return kv->v[i];
    return NULL;
}

static void key_value_repr(sb *err, const char *key, const char *value) {
    sb_printf(err, "%s=", key);
    py_repr_str(err, value, strlen(value));
}

/* int(text) for a str: a sign, decimal digits with single "_" between them, whitespace
 * around; 0 when int() would refuse it. Values beyond +-1e15 are clamped (out of any
 * range this daemon checks). */
static int py_int(const char *text, long long *out) {
    const char *s = text;
    size_t n = strlen(s), i = 0;
    py_strip(&s, &n);
    int neg = 0, digits = 0;
    if (i < n && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
    long long v = 0;
    for (; i < n; i++) {
        if (s[i] == '_' && digits && i + 1 < n && is_digit((unsigned char)s[i + 1])) continue;
        if (!is_digit((unsigned char)s[i])) return 0;
        if (v < 1000000000000000LL) v = v * 10 + (s[i] - '0');
        digits++;
    }
    if (!digits) return 0;
    *out = neg ? -v : v;
    return 1;
}

/* _int: int(value) within lo..hi */
static int cfg_int(const char *key, const char *value, int lo, int hi, int *out, sb *err) {
    long long v;
    if (!py_int(value, &v)) {
        key_value_repr(err, key, value);
        sb_puts(err, ": not an integer");
        return -1;
    }
    if (v < lo || v > hi) {
        key_value_repr(err, key, value);
        sb_printf(err, ": out of range %d..%d", lo, hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int cfg_bool(const char *key, const char *value, int *out, sb *err) {
    if (strcmp(value, "0") && strcmp(value, "1")) {
        key_value_repr(err, key, value);
        sb_puts(err, ": expected 0 or 1");
        return -1;
    }
    *out = value[0] == '1';
    return 0;
}

static int cfg_ip(const char *key, const char *value, char **out, sb *err) {
    char ip[INET6_ADDRSTRLEN + 64];
    if (!*value) {
        set_str(out, "");
        return 0;
    }
    if (!py_ip_normalize(value, ip, sizeof ip)) {
        key_value_repr(err, key, value);
        sb_puts(err, ": not an IP address");
        return -1;
    }
    set_str(out, ip);
    return 0;
}

/* The TLS keys are checked as TlsFiles.from_values checks them; a good TLS config is still
 * refused: this daemon does plain TCP only (the sandbox runs TLS ensembles on Python). */
static int cfg_tls(const kv_parse *kv, sb *err) {
    static const char *const keys[] = {"IMEX_SERVER_KEY", "IMEX_SERVER_CERT", "IMEX_SERVER_CERT_AUTH",
                                       "IMEX_CLIENT_KEY", "IMEX_CLIENT_CERT", "IMEX_CLIENT_CERT_AUTH"};
    const char *mode = kv_get(kv, "IMEX_AUTH_ENCRYPTION_MODE"), *src = kv_get(kv, "IMEX_AUTH_SOURCE");
    if (!str_eq(mode, "SSL_TLS")) {
        key_value_repr(err, "IMEX_AUTH_ENCRYPTION_MODE", mode ? mode : "");
        sb_puts(err, ": the stand-in implements SSL_TLS only");
        return -1;
    }
    if (!str_eq(src, "FILE")) {
        key_value_repr(err, "IMEX_AUTH_SOURCE", src ? src : "");
        sb_puts(err, ": the stand-in implements FILE only");
        return -1;
    }
    sb missing = {0};
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
        const char *v = kv_get(kv, keys[i]);
        if (!v || !*v) sb_printf(&missing, "%s%s", missing.n ? ", " : "", keys[i]);
    }
    if (missing.n) sb_printf(err, "IMEX_ENABLE_AUTH_ENCRYPTION=1 needs %s", missing.p);
    else sb_puts(err, "IMEX_ENABLE_AUTH_ENCRYPTION=1: the C stand-in does not do TLS (the Python "
                      "one does: IMEX_STANDIN_IMPL=python)");
    sb_free(&missing);
    return -1;
}

/* parse_config, key by key in the Python's order (its first error is the one reported) */
static int parse_config(const char *text, size_t len, config *cfg, sb *err) {
    kv_parse kv = {0};
    int rc = -1, tls = 0;
    const char *v;
    py_splitlines(text, len, config_line, &kv);
    if (kv.err.n) {
        sb_add(err, kv.err.p, kv.err.n);
        goto out;
    }
    if ((v = kv_get(&kv, "SERVER_PORT")) && cfg_int("SERVER_PORT", v, 1, 65535, &cfg->server_port, err)) goto out;
    if ((v = kv_get(&kv, "IMEX_NODE_CONFIG_FILE")) && *v) {
        free(cfg->node_config_file);
        cfg->node_config_file = py_path(v);
    }
    if ((v = kv_get(&kv, "BIND_INTERFACE_IP")) && cfg_ip("BIND_INTERFACE_IP", v, &cfg->bind_ip, err)) goto out;
    if ((v = kv_get(&kv, "IMEX_CMD_ENABLED")) && cfg_bool("IMEX_CMD_ENABLED", v, &cfg->cmd_enabled, err)) goto out;
    if ((v = kv_get(&kv, "IMEX_CMD_PORT")) && cfg_int("IMEX_CMD_PORT", v, 1, 65535, &cfg->cmd_port, err)) goto out;
    if ((v = kv_get(&kv, "IMEX_CMD_BIND_INTERFACE_IP")) &&
        cfg_ip("IMEX_CMD_BIND_INTERFACE_IP", v, &cfg->cmd_ip, err)) goto out;
    if ((v = kv_get(&kv, "LOG_FILE_NAME"))) set_str(&cfg->log_file, v);
    if ((v = kv_get(&kv, "DAEMONIZE")) && cfg_bool("DAEMONIZE", v, &cfg->daemonize, err)) goto out;
    v = kv_get(&kv, "IMEX_ENABLE_AUTH_ENCRYPTION");
    if (cfg_bool("IMEX_ENABLE_AUTH_ENCRYPTION", v ? v : "0", &tls, err)) goto out;
    if (tls) {
        cfg_tls(&kv, err);
        goto out;
    }
    rc = 0;
out:
    for (int i = 0; i < kv.n; i++) free(kv.k[i]), free(kv.v[i]);
    free(kv.k);
    free(kv.v);
    sb_free(&kv.err);
    return rc;
}

/* load_config: the message on failure is what main prints after "nvidia-imex: " */
static int load_config(const char *path, config *cfg, sb *err) {
    memset(cfg, 0, sizeof *cfg);
    cfg->server_port = 50000;
    cfg->node_config_file = xstrdup("/etc/nvidia-imex/nodes_config.cfg");
    cfg->bind_ip = xstrdup("");
    cfg->cmd_enabled = 1;
    cfg->cmd_port = 50005;
    cfg->cmd_ip = xstrdup("");
    cfg->log_file = xstrdup("");
    char *text;
    size_t len;
    if (read_file(path, &text, &len) != 0) {
        int e = errno;
        sb_printf(err, "cannot read config %s: ", path);
        os_error(err, e, path);
        return -1;
    }
    sb why = {0};
    int rc = utf8_check((const unsigned char *)text, len, 0, &why);
    if (rc == 0) rc = parse_config(text, len, cfg, &why);
    if (rc) sb_printf(err, "%s: %s", path, sb_str(&why));
    sb_free(&why);
    free(text);
    return rc;
}

/* ------------------------------------------------------------------ the node map */

typedef struct { char **e; int n; } entries_t;

static void nodes_line(const char *line, size_t n, void *arg) {
    entries_t *l = arg;
    py_strip(&line, &n);
    if (!n || line[0] == '#') return;
    l->e = xrealloc(l->e, (size_t)(l->n + 1) * sizeof *l->e);
    l->e[l->n++] = xstrndup(line, n);
}

/* read_nodes: the entries in order; blank lines and comments are no nodes */
static int read_nodes(const char *path, entries_t *out, sb *err) {
    char *text;
    size_t len;
    if (read_file(path, &text, &len) != 0) {
        int e = errno;
        sb_printf(err, "cannot read node configuration file %s: ", path);
        os_error(err, e, path);
        return -1;
    }
    sb why = {0};
    if (utf8_check((const unsigned char *)text, len, 0, &why)) {
        sb_printf(err, "cannot read node configuration file %s: %s", path, why.p);
        sb_free(&why);
        free(text);
        return -1;
    }
    py_splitlines(text, len, nodes_line, out);
    free(text);
    return 0;
}

/* nodes_hash: sha256 of the entries joined by newlines, its first 16 hex digits */
static void nodes_hash(const entries_t *l, char out[17]) {
    sb b = {0};
    for (int i = 0; i < l->n; i++) {
        if (i) sb_putc(&b, '\n');
        sb_puts(&b, l->e[i]);
    }
    char hex[65];
    sha256_hex(b.p ? b.p : "", b.n, hex);
    memcpy(out, hex, 16);
    out[16] = 0;
    sb_free(&b);
}

/* local_addresses: every address on this network namespace's interfaces */
static int local_addresses(addrs_t *out, sb *err) {
    struct ifaddrs *ifa, *i;
    if (getifaddrs(&ifa) != 0) {
        sb_puts(err, "cannot list local addresses: ");
        os_error(err, errno, NULL);
        return -1;
    }
    char txt[INET6_ADDRSTRLEN], ip[INET6_ADDRSTRLEN + 64];
    for (i = ifa; i; i = i->ifa_next) {
        if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6)) continue;
        sockaddr_text(i->ifa_addr, txt, sizeof txt);
        if (py_ip_normalize(txt, ip, sizeof ip)) addrs_add(out, ip);
    }
    freeifaddrs(ifa);
    return 0;
}

/* resolve_all: what the system resolver gives host at start-up (empty when it fails) */
static void resolve_all(const char *host, addrs_t *out) {
    sb why = {0};
    if (idna_refuses(host, &why)) {
        logmsg(L_INFO, "cannot resolve %s: %s", host, why.p);
        sb_free(&why);
        return;
    }
    struct addrinfo hints = {0}, *res;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(host, NULL, &hints, &res);
    if (rc != 0) {
        gai_error_text(&why, rc, errno);
        logmsg(L_INFO, "cannot resolve %s: %s", host, why.p);
        sb_free(&why);
        return;
    }
    addrs_from_ai(out, res);
    freeaddrinfo(res);
}

/* ------------------------------------------------------------------ the daemon's state */

enum phase {
    PH_WAIT,    /* before the next attempt (the retry delay) */
    PH_DNS,     /* a resolver lookup is under way (getaddrinfo_a) */
    PH_CONNECT, /* a connect() to addrs[cur] is under way */
    PH_HELLO,   /* connected, our hello sent, the peer's due */
    PH_UP       /* handshake done: CONNECTED or MISMATCH, pinged by the keepalive */
};

/* one TCP connection's buffers, and its place in the epoll set */
typedef struct {
    int kind;     /* what it is (K_*): what an epoll event on it means */
    void *owner;  /* the peer, incoming or cmdconn it belongs to */
    uint32_t ev;  /* the events it is registered for (0: not in the set) */
    int fd;
    sb in;  /* bytes after the last complete line */
    sb out; /* bytes the socket has not taken yet */
    size_t out_off;
} conn;

typedef struct dnsq dnsq;

/* One outgoing link (PeerLink and its _peer_loop task): the row -N -j prints. */
typedef struct {
    int index;
    char *host;
    const char *status;
    long changed;      /* int(time.time()) of the last status change */
    char *ip;          /* the address last dialled, NULL before the first */
    char *remote;      /* the peer's own view, the JSON its last full pong carried */
    char *last_error;
    int connects, attempts;
    int started;       /* its loop runs (the task exists) */
    int phase;
    double due;        /* monotonic: retry time, connect deadline or hello deadline */
    double delay;      /* the next retry delay: 0.5 s doubling to 3 s */
    double t_try;      /* wall clock: when this step began (the attempt log's "t") */
    double heard;      /* monotonic: the last line heard on the live link */
    int first_ping;    /* handshake done in this read: ping once its other lines are read */
    int dial_errno;    /* PH_CONNECT without a socket: connect() failed at once with this */
    conn c;
    dnsq *dns;
    addrs_t addrs;     /* this attempt's addresses, dialled in order */
    int cur;
    char *dial_err;    /* the error of the last address that failed */
} peer;

/* one getaddrinfo_a request; a peer that gives up on it (SIGUSR1) leaves it to finish */
struct dnsq {
    struct gaicb cb;
    struct addrinfo hints;
    char port[8];
    char *host;
    peer *owner; /* NULL once orphaned */
    dnsq *next;
};

/* one incoming link (the dialler's hello, then its pings) */
typedef struct {
    conn c;
    double heard, hello_due;
    int greeted, dead;
    long sent_gen; /* the view generation its last pong carried (-1: none yet) */
} incoming;

/* one command-port connection: one request line, one reply line */
typedef struct {
    conn c;
    double due;
    int answered, dead;
} cmdconn;

typedef struct { double t; int acted, early; } siglog_t;
typedef struct { char *ip; int n; } ipcount;

static struct {
    /* options */
    char *config_path, *state_file, *state_tmp, *pid_file, *attempt_log, *version;
    const char *stuck_state;
    double ready_delay, usr1_window;
    config cfg;
    /* the node map */
    entries_t nodes;
    int node_id;
    char *own_ip;
    char map_hash[17];
    const char *state;
    peer *peers;
    int npeers;
    /* counters */
    int sig_received, sig_acted, sig_ignored;
    siglog_t *siglog;
    int nsiglog;
    int acted_once;
    double last_acted;
    int starts;
    double started_at;
    int alog_fd;
    ipcount *by_ip;
    int nby_ip;
    /* sockets and timers */
    int listen_fd, cmd_fd;
    incoming **inc;
    int ninc;
    cmdconn **cmd;
    int ncmd;
    dnsq *dns;
    int state_due, stop;
    long view_gen;     /* bumped by every change of what our own view shows */
    sb view_line;      /* the pong carrying it, encoded once per generation */
    long view_line_gen;
    sb hello;          /* the handshake line: the same for every link */
    double next_tick, last_tick;
    int ready_pending;
    double ready_due;
    int daemon_pipe;   /* DAEMONIZE: to the parent waiting for "OK" (-1: none) */
} D;

static char rbuf[READ_CHUNK]; /* every socket read lands here first */

static void write_state(void) { /* at the end of this turn of the loop */
    if (D.state_file) D.state_due = 1;
}
static void view_changed(void) { D.view_gen++; }

static void set_state(const char *state) {
    if (!strcmp(state, D.state)) return;
    logmsg(L_INFO, "state %s -> %s", D.state, state);
    D.state = state;
    view_changed();
    write_state();
}

static void peer_set_status(peer *p, const char *status) {
    if (!strcmp(status, p->status)) return;
    p->status = status;
    p->changed = (long)wall_now();
    view_changed();
}
static void peer_set_ip(peer *p, const char *ip) {
    if (str_eq(ip, p->ip)) return;
    set_str(&p->ip, ip);
    view_changed();
}
static void peer_set_lost(peer *p) { /* DISCONNECTED once it has been connected */
    peer_set_status(p, p->connects ? "DISCONNECTED" : "NEVER_CONNECTED");
}

/* ------------------------------------------------------------------ views */

/* own_view: this node's entry of -N -j, from the links it holds right now */
static jv *own_view(void) {
    jv *v = jnew(J_OBJ), *conns = jnew(J_OBJ);
    jput(v, "status", jstr(D.state));
    jput(v, "host", jstr(D.own_ip));
    jput(v, "hostName", jstr(D.nodes.e[D.node_id]));
    for (int i = 0; i < D.npeers; i++) {
        peer *p = &D.peers[i];
        jv *c = jnew(J_OBJ);
        jput(c, "host", jstr(p->ip ? p->ip : p->host));
        jput(c, "status", jstr(p->status));
        jput(c, "changed", jint(p->changed));
        char key[16];
        snprintf(key, sizeof key, "%d", p->index);
        jput(conns, key, c);
    }
    jput(v, "connections", conns);
    jput(v, "version", jstr(D.version));
    return v;
}

/* the pong that carries own_view, encoded again only when the view changed */
static const sb *own_view_line(void) {
    if (D.view_line.n && D.view_line_gen == D.view_gen) return &D.view_line;
    jv *pong = jnew(J_OBJ);
    jput(pong, "type", jstr("pong"));
    jput(pong, "status", own_view());
    D.view_line.n = 0;
    json_dump(&D.view_line, pong, 0, 1);
    sb_putc(&D.view_line, '\n');
    jfree(pong);
    D.view_line_gen = D.view_gen;
    return &D.view_line;
}

/* domain_view: our own entry, each connected peer's own entry as relayed over our link
 * (parsed: for the table; else as the JSON it is kept as), a peer without a link
 * UNAVAILABLE with every connection INVALID; nodes in numeric order */
static jv *domain_view(int parsed) {
    jv *d = jnew(J_OBJ), *nodes = jnew(J_OBJ);
    for (int id = 0; id < D.nodes.n; id++) {
        char key[16];
        snprintf(key, sizeof key, "%d", id);
        if (id == D.node_id) {
            jput(nodes, key, own_view());
            continue;
        }
        peer *p = &D.peers[id < D.node_id ? id : id - 1];
        if (!strcmp(p->status, "CONNECTED") && p->remote) {
            sb ignored = {0};
            jv *r = parsed ? json_loads(p->remote, strlen(p->remote), &ignored) : jraw(p->remote);
            sb_free(&ignored);
            jput(nodes, key, r ? r : jnew(J_NULL));
            continue;
        }
        jv *n = jnew(J_OBJ), *conns = jnew(J_OBJ);
        jput(n, "status", jstr("UNAVAILABLE"));
        jput(n, "host", jstr(p->ip ? p->ip : p->host));
        jput(n, "hostName", jstr(p->host));
        for (int j = 0; j < D.nodes.n; j++) {
            if (j == id) continue;
            jv *c = jnew(J_OBJ);
            jput(c, "host", jstr(D.nodes.e[j]));
            jput(c, "status", jstr("INVALID"));
            jput(c, "changed", jint(0));
            char k2[16];
            snprintf(k2, sizeof k2, "%d", j);
            jput(conns, k2, c);
        }
        jput(n, "connections", conns);
        jput(n, "version", jstr(""));
        jput(nodes, key, n);
    }
    jput(d, "nodes", nodes);
    jput(d, "timestamp", jint((long long)wall_now()));
    const char *status = "UP";
    if (strcmp(D.state, "READY")) status = "DOWN";
    else
        for (int i = 0; i < D.npeers; i++)
            if (strcmp(D.peers[i].status, "CONNECTED")) status = "DEGRADED";
    jput(d, "status", jstr(status));
    return d;
}

static int ipcount_cmp(const void *a, const void *b) {
    return strcmp(((const ipcount *)a)->ip, ((const ipcount *)b)->ip);
}

/* state_doc: what the state file and the "stats" command show */
static jv *state_doc(void) {
    jv *d = jnew(J_OBJ), *a;
    jput(d, "pid", jint(getpid()));
    jput(d, "state", jstr(D.state));
    jput(d, "node_id", jint(D.node_id));
    jput(d, "own_ip", jstr(D.own_ip));
    jput(d, "map_hash", jstr(D.map_hash));
    a = jnew(J_ARR);
    for (int i = 0; i < D.nodes.n; i++) jpush(a, jstr(D.nodes.e[i]));
    jput(d, "nodes", a);
    jput(d, "starts", jint(D.starts));
    jput(d, "started", jfloat(D.started_at));
    jput(d, "signals_received", jint(D.sig_received));
    jput(d, "signals_acted", jint(D.sig_acted));
    jput(d, "signals_ignored", jint(D.sig_ignored));
    a = jnew(J_ARR);
    for (int i = 0; i < D.nsiglog; i++) {
        jv *e = jnew(J_OBJ);
        jput(e, "t", jfloat(D.siglog[i].t));
        jput(e, "acted", jbool(D.siglog[i].acted));
        if (D.siglog[i].early) jput(e, "early", jbool(1));
        jpush(a, e);
    }
    jput(d, "signal_log", a);
    a = jnew(J_OBJ);
    for (int i = 0; i < D.npeers; i++) {
        peer *p = &D.peers[i];
        jv *e = jnew(J_OBJ);
        jput(e, "host", jstr(p->host));
        jput(e, "ip", jstr_or_null(p->ip));
        jput(e, "status", jstr(p->status));
        jput(e, "connects", jint(p->connects));
        jput(e, "attempts", jint(p->attempts));
        jput(e, "last_error", jstr(p->last_error));
        char key[16];
        snprintf(key, sizeof key, "%d", p->index);
        jput(a, key, e);
    }
    jput(d, "peers", a);
    if (D.nby_ip > 1) qsort(D.by_ip, (size_t)D.nby_ip, sizeof *D.by_ip, ipcount_cmp);
    a = jnew(J_OBJ);
    for (int i = 0; i < D.nby_ip; i++) jput(a, D.by_ip[i].ip, jint(D.by_ip[i].n));
    jput(d, "attempts_by_ip", a);
    jput(d, "running", jbool(strcmp(D.state, "SHUTTING_DOWN") != 0));
    jput(d, "tls", jbool(0));
    jput(d, "tls_reloads", jint(0));
    jput(d, "event_loop", jstr("c"));
    jput(d, "auth_refusals", jnew(J_ARR));
    jput(d, "updated", jfloat(wall_now()));
    return d;
}

/* The state file, whole, atomically (tmp + rename), sorted keys as json.dumps(sort_keys=True). */
static void write_state_now(void) {
    D.state_due = 0;
    if (!D.state_file) return;
    jv *doc = state_doc();
    sb text = {0};
    json_dump(&text, doc, 1, 0);
    jfree(doc);
    sb err = {0};
    int fd = open(D.state_tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) {
        os_error(&err, errno, D.state_tmp);
    } else {
        int bad = write_all(fd, text.p, text.n) ? errno : 0;
        if (close(fd) && !bad) bad = errno;
        if (bad) os_error(&err, bad, D.state_tmp);
        else if (rename(D.state_tmp, D.state_file)) {
            os_error(&err, errno, D.state_tmp);
            sb_puts(&err, " -> ");
            py_repr_str(&err, D.state_file, strlen(D.state_file));
        }
    }
    if (err.n) logmsg(L_WARNING, "cannot write state file %s: %s", D.state_file, err.p);
    sb_free(&err);
    sb_free(&text);
}

/* _previous_starts: int(previous state file's "starts"), 0 when there is none to read */
static int previous_starts(void) {
    char *text;
    size_t len;
    if (!D.state_file || read_file(D.state_file, &text, &len) != 0) return 0;
    sb err = {0};
    jv *doc = json_loads(text, len, &err), *s = jget(doc, "starts");
    long long n = 0;
    if (s && s->t == J_INT && !s->big) n = s->i;
    else if (s && s->t == J_FLOAT && isfinite(s->d) && fabs(s->d) < 1e15) n = (long long)s->d;
    else if (s && s->t == J_TRUE) n = 1;
    else if (s && s->t == J_STR && !py_int(s->s, &n)) n = 0; /* int("7"); junk reads 0 */
    jfree(doc);
    sb_free(&err);
    free(text);
    return (int)n;
}

/* ------------------------------------------------------------------ the attempt log */
/* One JSON line per outgoing attempt, lost link and the start of listening, each one write()
 * on an O_APPEND descriptor (a reader never sees half a line). */

static void alog_write(jv *ev) {
    if (D.alog_fd >= 0) {
        sb b = {0};
        json_dump(&b, ev, 0, 1);
        sb_putc(&b, '\n');
        if (write(D.alog_fd, b.p, b.n) < 0) { /* as the Python: a lost line is no error */ }
        sb_free(&b);
    }
    jfree(ev);
}

static void alog_attempt(peer *p, const char *ip, const char *outcome, double t, const char *error) {
    p->attempts++;
    if (ip) {
        int i = 0;
        while (i < D.nby_ip && strcmp(D.by_ip[i].ip, ip)) i++;
        if (i == D.nby_ip) {
            D.by_ip = xrealloc(D.by_ip, (size_t)(D.nby_ip + 1) * sizeof *D.by_ip);
            D.by_ip[D.nby_ip++] = (ipcount){xstrdup(ip), 0};
        }
        D.by_ip[i].n++;
    }
    if (D.alog_fd < 0) return;
    jv *ev = jnew(J_OBJ);
    jput(ev, "ev", jstr("attempt"));
    jput(ev, "t", jfloat(t));
    jput(ev, "te", jfloat(wall_now()));
    jput(ev, "peer", jint(p->index));
    jput(ev, "host", jstr(p->host));
    jput(ev, "ip", jstr_or_null(ip));
    jput(ev, "outcome", jstr(outcome));
    jput(ev, "error", jstr(error));
    alog_write(ev);
}

static void alog_lost(peer *p, const char *error) {
    if (D.alog_fd < 0) return;
    jv *ev = jnew(J_OBJ);
    jput(ev, "ev", jstr("lost"));
    jput(ev, "t", jfloat(wall_now()));
    jput(ev, "peer", jint(p->index));
    jput(ev, "host", jstr(p->host));
    jput(ev, "ip", jstr_or_null(p->ip));
    jput(ev, "error", jstr(error));
    alog_write(ev);
}

static void alog_listening(void) {
    if (D.alog_fd < 0) return;
    jv *ev = jnew(J_OBJ);
    jput(ev, "ev", jstr("listening"));
    jput(ev, "t", jfloat(wall_now()));
    jput(ev, "ip", jstr(D.own_ip));
    jput(ev, "port", jint(D.cfg.server_port));
    alog_write(ev);
}

/* ------------------------------------------------------------------ connections */

static void conn_init(conn *c, int fd) {
    memset(c, 0, sizeof *c);
    c->fd = fd;
}

/* What an epoll event's pointer leads to (a conn, or one of the fixed descriptors). */
enum { K_SIG = 1, K_LISTEN, K_CMDLISTEN, K_PEER, K_INC, K_CMD };
static int epfd = -1;

/* c registered for events (added, or modified: one syscall only when they change); a
 * closed socket leaves the set by itself */
static void watch(conn *c, int kind, void *owner, uint32_t events) {
    if (c->fd < 0 || c->ev == events) return;
    struct epoll_event e;
    memset(&e, 0, sizeof e);
    e.events = events;
    e.data.ptr = c;
    c->kind = kind;
    c->owner = owner;
    if (epoll_ctl(epfd, c->ev ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, c->fd, &e) == 0) c->ev = events;
}

/* close the socket, first handing it what is still queued (transport.close() flushes) */
static void conn_close(conn *c) {
    if (c->fd >= 0) {
        if (c->out.n > c->out_off)
            if (send(c->fd, c->out.p + c->out_off, c->out.n - c->out_off, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
                /* the peer is gone: nothing to flush to */
            }
        close(c->fd);
    }
    c->fd = -1;
    c->ev = 0;
    sb_free(&c->in);
    sb_free(&c->out);
    c->out_off = 0;
}

/* queue bytes, writing at once what the socket takes; 0 or the errno of a failed send */
static int conn_send(conn *c, const char *p, size_t n) {
    if (c->fd < 0) return 0; /* closing: a write is dropped, as on a closing transport */
    if (c->out.n == c->out_off) {
        c->out.n = c->out_off = 0;
        ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && errno != EAGAIN && errno != EINTR) return errno;
        if (w > 0) p += w, n -= (size_t)w;
    }
    if (n) sb_add(&c->out, p, n);
    return 0;
}

/* write what is queued (EPOLLOUT); 0 or the errno of a failed send */
static int conn_flush(conn *c) {
    while (c->out.n > c->out_off) {
        ssize_t w = send(c->fd, c->out.p + c->out_off, c->out.n - c->out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) return errno == EAGAIN || errno == EINTR ? 0 : errno;
        c->out_off += (size_t)w;
    }
    c->out.n = c->out_off = 0;
    return 0;
}

/* One read (as one data_received); >0 bytes in rbuf, 0 at EOF, -errno (-EAGAIN: nothing). */
static ssize_t conn_read(conn *c) {
    ssize_t r = recv(c->fd, rbuf, sizeof rbuf, MSG_DONTWAIT);
    if (r < 0) return errno == EINTR ? -EAGAIN : -errno;
    return r;
}

/* Split what a read brought into lines as LineLink.data_received does: each complete line
 * (with its "\n") to fn, which returns nonzero when it ended the connection (stop there);
 * the rest is kept for the next read. 1: the connection ended; 2: the rest is longer than
 * MAX_LINE ("line too long or unterminated"); 0 otherwise. */
static int conn_lines(conn *c, const char *data, size_t n, int (*fn)(void *, const char *, size_t),
                      void *obj) {
    const char *buf = data;
    size_t len = n, start = 0;
    if (c->in.n) {
        sb_add(&c->in, data, n);
        buf = c->in.p, len = c->in.n;
    }
    const char *nl;
    while ((nl = memchr(buf + start, '\n', len - start))) {
        size_t end = (size_t)(nl - buf) + 1;
        if (fn(obj, buf + start, end - start)) return 1;
        start = end;
    }
    if (buf == c->in.p) {
        memmove(c->in.p, c->in.p + start, len - start);
        c->in.n = len - start;
    } else if (start < len) {
        sb_add(&c->in, buf + start, len - start);
    }
    return c->in.n > MAX_LINE ? 2 : 0;
}

static void set_nodelay(int fd) { /* asyncio's transports do: a line goes out at once */
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* a numeric address (a resolver's, or /etc/hosts' normalised text) and port as a sockaddr */
static int numeric_sockaddr(const char *ip, int port, struct sockaddr_storage *sa, socklen_t *len,
                            int *gai) {
    struct addrinfo hints = {0}, *res;
    char svc[8];
    snprintf(svc, sizeof svc, "%d", port);
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    hints.ai_socktype = SOCK_STREAM;
    *gai = getaddrinfo(ip, svc, &hints, &res);
    if (*gai) return -1;
    memcpy(sa, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

/* ------------------------------------------------------------------ outgoing links */
/* _peer_loop as a state machine: resolve (/etc/hosts here, anything else through
 * getaddrinfo_a), dial each address in order (2 s each), send our hello and wait 3 s for
 * the peer's, then hold the link until it ends; after a failure wait 0.5 s doubling to 3 s
 * and start again, resolving afresh. Every step logs and counts as the Python's does. */

static void peer_attempt(peer *p);
static void dial_next(peer *p);

static void peer_release(peer *p) { /* drop the socket and any lookup, keep the counters */
    conn_close(&p->c);
    if (p->dns) {
        p->dns->owner = NULL;
        gai_cancel(&p->dns->cb); /* if it already runs, it finishes and is freed then */
        p->dns = NULL;
    }
    addrs_free(&p->addrs);
    free(p->dial_err);
    p->dial_err = NULL;
    p->first_ping = 0;
    p->dial_errno = 0;
}

/* The outer except of _peer_loop: an attempt or a live link failed with msg; retry later.
 * logged: the attempt log has this outcome already (else it gets one, as "outcome"). */
static void peer_fail(peer *p, const char *msg, const char *outcome, int logged) {
    char *m = xstrdup(msg);
    if (!logged) alog_attempt(p, p->ip, outcome, wall_now(), m);
    if (!strcmp(p->status, "CONNECTED") || strcmp(m, p->last_error))
        logmsg(L_INFO, "peer %d (%s): %s; retrying", p->index, p->host, m);
    free(p->last_error);
    p->last_error = m;
    free(p->remote);
    p->remote = NULL;
    peer_set_lost(p);
    write_state();
    peer_release(p);
    p->phase = PH_WAIT;
    p->due = mono_now() + p->delay;
    p->delay = p->delay * 2 < RETRY_MAX_S ? p->delay * 2 : RETRY_MAX_S;
}

/* The link's socket ended or failed (EOF, an error, a bad line, the keepalive): during the
 * handshake that is this attempt's outcome; on a live link it is a lost link. */
static void peer_conn_ended(peer *p, const char *msg, int err) {
    if (p->phase == PH_HELLO) {
        alog_attempt(p, p->ip, outcome_of(err), p->t_try, msg);
    } else {
        alog_lost(p, msg);
    }
    peer_fail(p, msg, NULL, 1);
}

/* write to the link; 0, or -1 when the write ended it */
static int peer_send(peer *p, const char *data, size_t n) {
    int err = conn_send(&p->c, data, n);
    if (!err) return 0;
    peer_conn_ended(p, errno_text(err), err);
    return -1;
}

/* the addresses this attempt dials, in order */
static void peer_resolved(peer *p) {
    if (p->addrs.n && !str_eq(p->addrs.a[0], p->ip)) {
        sb list = {0};
        for (int i = 0; i < p->addrs.n; i++) sb_printf(&list, "%s%s", i ? ", " : "", p->addrs.a[i]);
        logmsg(L_INFO, "peer %d %s resolves to %s", p->index, p->host, list.p);
        sb_free(&list);
    }
    if (!p->addrs.n) {
        alog_attempt(p, NULL, "no_address", wall_now(), "no address");
        peer_fail(p, "the resolver returned no address", NULL, 1);
        return;
    }
    p->cur = 0;
    dial_next(p);
}

/* a lookup through getaddrinfo_a ended (from the loop: dns_poll) */
static void peer_dns_done(peer *p, int rc, const struct addrinfo *res) {
    p->dns = NULL;
    if (rc != 0) {
        sb msg = {0};
        gai_error_text(&msg, rc, 0);
        alog_attempt(p, NULL, "no_address", p->t_try, msg.p);
        peer_fail(p, msg.p, NULL, 1);
        sb_free(&msg);
        return;
    }
    addrs_from_ai(&p->addrs, res);
    peer_resolved(p);
}

static void dns_start(peer *p) {
    dnsq *q = xcalloc(sizeof *q);
    q->host = xstrdup(p->host);
    snprintf(q->port, sizeof q->port, "%d", D.cfg.server_port);
    q->hints.ai_socktype = SOCK_STREAM;
    q->cb.ar_name = q->host;
    q->cb.ar_service = q->port;
    q->cb.ar_request = &q->hints;
    struct gaicb *list[1] = {&q->cb};
    struct sigevent sev;
    memset(&sev, 0, sizeof sev);
    sev.sigev_notify = SIGEV_SIGNAL; /* its completion wakes the loop through the pipe */
    sev.sigev_signo = SIGRTMIN;
    int rc = getaddrinfo_a(GAI_NOWAIT, list, 1, &sev);
    if (rc) {
        free(q->host);
        free(q);
        peer_dns_done(p, rc, NULL);
        return;
    }
    q->owner = p;
    q->next = D.dns;
    D.dns = q;
    p->dns = q;
    p->phase = PH_DNS;
}

/* lookups that ended: their peers go on (an orphaned one is only freed) */
static void dns_poll(void) {
    dnsq **pp = &D.dns, *done = NULL;
    while (*pp) {
        dnsq *q = *pp;
        if (gai_error(&q->cb) == EAI_INPROGRESS) {
            pp = &q->next;
            continue;
        }
        *pp = q->next;
        q->next = done;
        done = q;
    }
    while (done) {
        dnsq *q = done;
        done = q->next;
        if (q->owner) peer_dns_done(q->owner, gai_error(&q->cb), q->cb.ar_result);
        if (q->cb.ar_result) freeaddrinfo(q->cb.ar_result);
        free(q->host);
        free(q);
    }
}

/* one turn of _peer_loop from its top: resolve again */
static void peer_attempt(peer *p) {
    p->t_try = wall_now();
    if (hosts_lookup(p->host, &p->addrs)) {
        peer_resolved(p);
        return;
    }
    sb why = {0};
    if (idna_refuses(p->host, &why)) /* Python's UnicodeError, before any lookup */
        peer_fail(p, why.p, "error", 0);
    else
        dns_start(p);
    sb_free(&why);
}

/* connected: greet and wait for the peer's hello */
static void peer_dialled(peer *p) {
    p->t_try = wall_now();
    p->phase = PH_HELLO;
    p->due = mono_now() + PEER_TIMEOUT_S;
    peer_send(p, D.hello.p, D.hello.n);
}

/* one address failed to connect: log it, try the next */
static void dial_failed(peer *p, const char *msg, int err) {
    alog_attempt(p, p->ip, err ? outcome_of(err) : "timeout", p->t_try, msg);
    set_str(&p->dial_err, msg);
    conn_close(&p->c);
    p->cur++;
    dial_next(p);
}

/* where our own address is, to bind outgoing links to it (family permitting) */
static struct sockaddr_storage own_sa;
static socklen_t own_salen;

/* _dial: connect to addrs[cur] or, when that fails at once, the next; none left: the last
 * one's error ends this attempt */
static void dial_next(peer *p) {
    while (p->cur < p->addrs.n) {
        const char *ip = p->addrs.a[p->cur];
        peer_set_ip(p, ip);
        p->t_try = wall_now();
        struct sockaddr_storage sa;
        socklen_t salen;
        int gai, err = 0, fd = -1;
        if (numeric_sockaddr(ip, D.cfg.server_port, &sa, &salen, &gai)) {
            sb m = {0};
            gai_error_text(&m, gai, 0);
            alog_attempt(p, ip, "error", p->t_try, m.p);
            set_str(&p->dial_err, m.p);
            sb_free(&m);
            p->cur++;
            continue;
        }
        fd = socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) err = errno;
        /* the local end on our own address when the families match */
        if (!err && (strchr(ip, ':') != NULL) == (strchr(D.own_ip, ':') != NULL) && own_salen &&
            bind(fd, (struct sockaddr *)&own_sa, own_salen))
            err = errno;
        if (!err) {
            set_nodelay(fd);
            if (connect(fd, (struct sockaddr *)&sa, salen) == 0 || errno == EINPROGRESS) {
                int now = errno != EINPROGRESS;
                conn_init(&p->c, fd);
                if (now) {
                    peer_dialled(p);
                } else {
                    p->phase = PH_CONNECT;
                    p->due = mono_now() + CONNECT_TIMEOUT_S;
                }
                return;
            }
            err = errno;
        }
        if (fd >= 0) close(fd);
        /* told on the next turn of the loop, as uvloop reports even an immediate failure */
        p->dial_errno = err;
        p->phase = PH_CONNECT;
        p->due = mono_now();
        return;
    }
    peer_fail(p, p->dial_err ? p->dial_err : "no address", NULL, 1);
}

/* the connect() under way finished (EPOLLOUT) */
static void peer_connect_done(peer *p) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(p->c.fd, SOL_SOCKET, SO_ERROR, &err, &len)) err = errno;
    if (err) dial_failed(p, errno_text(err), err);
    else peer_dialled(p);
}

/* The peer's hello: its node id must be the one we dialled; its map hash decides between
 * CONNECTED and MISMATCH. 1 when the link ended. */
static int peer_hello(peer *p, const char *line, size_t n) {
    sb err = {0};
    jv *h = json_line(line, n, &err);
    if (h && !jeq_int(jget(h, "node_id"), p->index)) {
        sb_printf(&err, "peer at %s says it is node ", p->ip);
        py_str_jv(&err, jget(h, "node_id"));
        sb_printf(&err, ", expected %d", p->index);
    }
    if (err.n) {
        jfree(h);
        alog_attempt(p, p->ip, "error", p->t_try, err.p);
        peer_fail(p, err.p, NULL, 1);
        sb_free(&err);
        return 1;
    }
    int same = jis_str(jget(h, "map_hash"), D.map_hash);
    jfree(h);
    p->connects++;
    if (!same) {
        logmsg(L_WARNING, "peer %d (%s): node map mismatch, communication disabled", p->index, p->host);
        peer_set_status(p, "MISMATCH");
    } else {
        logmsg(L_INFO, "peer %d (%s at %s) connected", p->index, p->host, p->ip);
        peer_set_status(p, "CONNECTED");
    }
    alog_attempt(p, p->ip, same ? "connected" : "mismatch", p->t_try, "");
    set_str(&p->last_error, "");
    write_state();
    p->delay = RETRY_FIRST_S;
    p->phase = PH_UP;
    p->heard = mono_now();
    p->first_ping = 1; /* once the rest of this read is handled, as link.start() then write */
    return 0;
}

static int line_is(const char *line, size_t n, const char *want) {
    return n == strlen(want) && !memcmp(line, want, n);
}

/* A line on an outgoing link: the hello, then pongs; a pong carrying the peer's view
 * (its "status" object) replaces the view we relay. 1 when the link ended. */
static int peer_line(void *obj, const char *line, size_t n) {
    peer *p = obj;
    if (p->phase == PH_HELLO) return peer_hello(p, line, n);
    if (!line_is(line, n, PONG_LINE) && !line_is(line, n, PING_LINE)) {
        sb err = {0};
        jv *v = json_line(line, n, &err);
        if (!v) {
            peer_conn_ended(p, err.p, 0);
            sb_free(&err);
            return 1;
        }
        jv *view = jget(v, "status");
        if (view && view->t == J_OBJ) {
            sb text = {0};
            json_dump(&text, view, 0, 1); /* what json.dumps of the dict gives later */
            free(p->remote);
            p->remote = text.p;
        }
        jfree(v);
    }
    p->heard = mono_now();
    return 0;
}

static void peer_readable(peer *p) {
    ssize_t r = conn_read(&p->c);
    if (r == -EAGAIN) return;
    if (r <= 0) {
        peer_conn_ended(p, r ? errno_text((int)-r) : "connection closed", (int)-r);
        return;
    }
    int rc = conn_lines(&p->c, rbuf, (size_t)r, peer_line, p);
    if (rc == 1) return;
    if (rc == 2) {
        peer_conn_ended(p, "line too long or unterminated", 0);
        return;
    }
    if (p->first_ping) {
        p->first_ping = 0; /* the first ping now; the keepalive sends the next ones */
        peer_send(p, PING_LINE, sizeof PING_LINE - 1);
    }
}

/* a deadline passed: the retry delay, the connect timeout or the hello timeout */
static void peer_timer(peer *p) {
    switch (p->phase) {
    case PH_WAIT:
        peer_attempt(p);
        break;
    case PH_CONNECT:
        if (p->dial_errno) {
            int err = p->dial_errno;
            p->dial_errno = 0;
            dial_failed(p, errno_text(err), err);
        } else {
            dial_failed(p, "TimeoutError", 0);
        }
        break;
    case PH_HELLO:
        alog_attempt(p, p->ip, "timeout", p->t_try, "");
        peer_fail(p, "TimeoutError", NULL, 1);
        break;
    }
}

/* _restart_link: drop whatever the link is doing and start its loop afresh */
static void peer_restart(peer *p) {
    if (p->started) {
        peer_release(p);
        free(p->remote);
        p->remote = NULL;
        peer_set_lost(p);
    }
    p->started = 1;
    p->delay = RETRY_FIRST_S;
    p->phase = PH_WAIT;
    peer_attempt(p);
}

/* ------------------------------------------------------------------ incoming links */

static void inc_close(incoming *in, const char *why) {
    logmsg(L_DEBUG, "incoming connection ended: %s", why);
    conn_close(&in->c);
    in->dead = 1;
}

static int inc_send(incoming *in, const char *data, size_t n) {
    int err = conn_send(&in->c, data, n);
    if (err) inc_close(in, errno_text(err));
    return err ? -1 : 0;
}

/* A line on an incoming link: the dialler's hello (answered with ours), then its pings,
 * each answered with a pong that carries our view only when it changed since this link
 * last got one. 1 when the link ended. */
static int inc_line(void *obj, const char *line, size_t n) {
    incoming *in = obj;
    int ping = line_is(line, n, PING_LINE);
    jv *v = NULL;
    if (!ping) {
        sb err = {0};
        v = json_line(line, n, &err);
        if (!v) {
            inc_close(in, err.p);
            sb_free(&err);
            return 1;
        }
    }
    in->heard = mono_now();
    if (!in->greeted) {
        if (ping || !jis_str(jget(v, "type"), "hello")) {
            jfree(v);
            inc_close(in, "expected hello");
            return 1;
        }
        if (!jis_str(jget(v, "map_hash"), D.map_hash)) {
            sb id = {0};
            py_str_jv(&id, jget(v, "node_id"));
            logmsg(L_WARNING, "incoming node %s: node map mismatch", id.p);
            sb_free(&id);
        }
        jfree(v);
        if (inc_send(in, D.hello.p, D.hello.n)) return 1;
        in->greeted = 1;
        return 0;
    }
    if (!ping) ping = jis_str(jget(v, "type"), "ping");
    jfree(v);
    if (!ping) return 0;
    const sb *view = own_view_line();
    int fresh = in->sent_gen != D.view_gen;
    in->sent_gen = D.view_gen;
    return fresh ? inc_send(in, view->p, view->n) : inc_send(in, PONG_LINE, sizeof PONG_LINE - 1);
}

static void inc_readable(incoming *in) {
    ssize_t r = conn_read(&in->c);
    if (r == -EAGAIN) return;
    if (r <= 0) {
        inc_close(in, r ? errno_text((int)-r) : "connection closed");
        return;
    }
    int rc = conn_lines(&in->c, rbuf, (size_t)r, inc_line, in);
    if (rc == 2) inc_close(in, "line too long or unterminated");
}

static void accept_peers(void) {
    for (;;) {
        int fd = accept4(D.listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return;
        set_nodelay(fd);
        incoming *in = xcalloc(sizeof *in);
        conn_init(&in->c, fd);
        in->heard = mono_now();
        in->hello_due = in->heard + PEER_TIMEOUT_S;
        in->sent_gen = -1;
        D.inc = xrealloc(D.inc, (size_t)(D.ninc + 1) * sizeof *D.inc);
        D.inc[D.ninc++] = in;
    }
}

/* ------------------------------------------------------------------ the command port */

/* render_table: nvidia-imex-ctl -N as text; -1 where the Python's would raise (a relayed
 * view whose connections are no dict of dicts) */
static int render_table(const jv *domain, sb *out) {
    static const char *const marks[][2] = {
        {"CONNECTED", "C"}, {"DISCONNECTED", "D"}, {"NEVER_CONNECTED", "N"}, {"INVALID", "I"},
        {"MISMATCH", "!M!"}, {"AUTHENTICATING", "A"}, {"RECOVERING", "R"}};
    const jv *nodes = jget(domain, "nodes");
    sb_puts(out, "Domain State: ");
    py_str_jv(out, jget(domain, "status"));
    for (size_t i = 0; nodes && i < nodes->len; i++) {
        const jv *node = nodes->v[i];
        sb_printf(out, "\nNode #%s - ", nodes->k[i]);
        py_str_jv(out, jget(node, "host"));
        sb_puts(out, " - ");
        py_str_jv(out, jget(node, "status"));
        sb_puts(out, " - Version: ");
        py_str_jv(out, jget(node, "version"));
        const jv *conns = jget(node, "connections");
        int truthy = conns && !(conns->t == J_NULL || conns->t == J_FALSE ||
                                (conns->t == J_INT && !conns->big && !conns->i) ||
                                (conns->t == J_FLOAT && conns->d == 0) ||
                                ((conns->t == J_STR || conns->t == J_ARR || conns->t == J_OBJ) &&
                                 !conns->len && !conns->n));
        if (!truthy) continue;
        if (conns->t != J_OBJ) return -1;
        sb_puts(out, "\n    ");
        for (size_t j = 0; j < conns->len; j++) {
            const jv *c = conns->v[j];
            if (c->t != J_OBJ) return -1;
            const jv *st = jget(c, "status");
            if (st && (st->t == J_ARR || st->t == J_OBJ)) return -1; /* unhashable */
            const char *mark = "?";
            for (size_t m = 0; m < sizeof marks / sizeof *marks; m++)
                if (jis_str(st, marks[m][0])) mark = marks[m][1];
            sb_printf(out, "%s%s:%s", j ? " " : "", conns->k[j], mark);
        }
    }
    return 0;
}

static void cmd_close(cmdconn *k) {
    conn_close(&k->c);
    k->dead = 1;
}

static void cmd_failed(cmdconn *k, const char *why) {
    logmsg(L_INFO, "command connection: %s", why);
    cmd_close(k);
}

/* one request line (as StreamReader.readline returned it) answered, as _serve_cmd does */
static void cmd_request(cmdconn *k, const char *line, size_t n) {
    if (!n) {
        cmd_failed(k, "connection closed");
        return;
    }
    if (line[n - 1] != '\n') {
        cmd_failed(k, "line too long or unterminated");
        return;
    }
    sb err = {0};
    jv *req = json_line(line, n, &err);
    if (!req) {
        cmd_failed(k, err.p);
        sb_free(&err);
        return;
    }
    const jv *cmd = jget(req, "cmd");
    jv *reply;
    if (jis_str(cmd, "state")) {
        reply = jnew(J_OBJ);
        jput(reply, "state", jstr(D.state));
    } else if (jis_str(cmd, "nodes")) {
        reply = domain_view(0);
    } else if (jis_str(cmd, "stats")) {
        reply = state_doc();
    } else if (jis_str(cmd, "table")) { /* nvidia-imex-ctl -N without -j */
        jv *dom = domain_view(1);
        sb table = {0};
        int ok = render_table(dom, &table) == 0;
        jfree(dom);
        if (!ok) {
            logmsg(L_ERROR, "Unhandled exception in client_connected_cb");
            sb_free(&table);
            jfree(req);
            cmd_close(k);
            return;
        }
        reply = jnew(J_OBJ);
        jput(reply, "table", jstrn(sb_str(&table), table.n));
        sb_free(&table);
    } else {
        sb msg = {0};
        sb_puts(&msg, "unknown command ");
        py_repr_jv(&msg, cmd);
        reply = jnew(J_OBJ);
        jput(reply, "error", jstrn(msg.p, msg.n));
        sb_free(&msg);
    }
    jfree(req);
    sb out = {0};
    json_dump(&out, reply, 0, 1);
    sb_putc(&out, '\n');
    jfree(reply);
    int e = conn_send(&k->c, out.p, out.n);
    sb_free(&out);
    k->answered = 1;
    if (e) cmd_failed(k, errno_text(e));
    else if (k->c.out.n == k->c.out_off) cmd_close(k); /* all written: close; else at POLLOUT */
}

/* the request line as readline() with limit=MAX_LINE reads it */
static void cmd_readable(cmdconn *k) {
    ssize_t r = conn_read(&k->c);
    if (r == -EAGAIN) return;
    if (r < 0) {
        cmd_failed(k, errno_text((int)-r));
        return;
    }
    if (r == 0) { /* EOF: readline gives what there is */
        sb line = k->c.in;
        memset(&k->c.in, 0, sizeof k->c.in);
        cmd_request(k, sb_str(&line), line.n);
        sb_free(&line);
        return;
    }
    size_t old = k->c.in.n;
    sb_add(&k->c.in, rbuf, (size_t)r);
    const char *nl = memchr(k->c.in.p + old, '\n', (size_t)r);
    if (nl) {
        size_t isep = (size_t)(nl - k->c.in.p);
        if (isep > MAX_LINE) cmd_failed(k, "Separator is found, but chunk is longer than limit");
        else cmd_request(k, k->c.in.p, isep + 1);
    } else if (k->c.in.n > MAX_LINE) {
        cmd_failed(k, "Separator is not found, and chunk exceed the limit");
    }
}

static void accept_cmds(void) {
    for (;;) {
        int fd = accept4(D.cmd_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return;
        set_nodelay(fd);
        cmdconn *k = xcalloc(sizeof *k);
        conn_init(&k->c, fd);
        k->due = mono_now() + CMD_TIMEOUT_S;
        D.cmd = xrealloc(D.cmd, (size_t)(D.ncmd + 1) * sizeof *D.cmd);
        D.cmd[D.ncmd++] = k;
    }
}

/* ------------------------------------------------------------------ keepalive and signals */

/* Every PING_INTERVAL_S, one pass over every link: ping each live outgoing link, and drop a
 * link whose peer has been silent too long (PEER_TIMEOUT_S outgoing, four times that
 * incoming). A pass that comes late (this process was stopped or starved) has not yet read
 * what arrived meanwhile: it judges no silence. */
static void keepalive(void) {
    double now = mono_now();
    int judge = now - D.last_tick < 2 * PING_INTERVAL_S;
    D.last_tick = now;
    for (int i = 0; i < D.npeers; i++) {
        peer *p = &D.peers[i];
        if (p->phase != PH_UP) continue;
        if (judge && now - p->heard > PEER_TIMEOUT_S) peer_conn_ended(p, "TimeoutError", ETIMEDOUT);
        else peer_send(p, PING_LINE, sizeof PING_LINE - 1);
    }
    if (judge)
        for (int i = 0; i < D.ninc; i++)
            if (!D.inc[i]->dead && now - D.inc[i]->heard > PEER_TIMEOUT_S * 4) inc_close(D.inc[i], "no ping");
    D.next_tick = mono_now() + PING_INTERVAL_S; /* a sleep after the pass, as the Python's */
}

static int sig_pipe[2] = {-1, -1};
static volatile sig_atomic_t loop_running;
/* SIGUSR1s before the loop handles signals: counted, never acted on (nothing to redial) */
#define EARLY_MAX 1024
static double early_usr1[EARLY_MAX];
static volatile sig_atomic_t n_early;

static void on_signal(int sig) {
    int saved = errno;
    if (!loop_running) {
        if (sig == SIGUSR1 && n_early < EARLY_MAX) {
            struct timespec t;
            clock_gettime(CLOCK_REALTIME, &t);
            early_usr1[n_early++] = (double)t.tv_sec + (double)t.tv_nsec / 1e9;
        }
    } else {
        unsigned char c = (unsigned char)sig;
        if (write(sig_pipe[1], &c, 1) < 0) { /* pipe full: the loop is behind anyway */ }
    }
    errno = saved;
}

static void handle(int sig) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, NULL);
}

static void siglog_add(double t, int acted, int early) {
    D.siglog = xrealloc(D.siglog, (size_t)(D.nsiglog + 1) * sizeof *D.siglog);
    D.siglog[D.nsiglog++] = (siglog_t){t, acted, early};
}

/* SIGUSR1: restart every outgoing link (re-resolving names), at most once per window */
static void on_usr1(void) {
    double now = mono_now();
    D.sig_received++;
    int acted = !D.acted_once || now - D.last_acted >= D.usr1_window;
    siglog_add(wall_now(), acted, 0);
    if (D.nsiglog > SIGNAL_LOG_MAX) {
        memmove(D.siglog, D.siglog + (D.nsiglog - SIGNAL_LOG_MAX), SIGNAL_LOG_MAX * sizeof *D.siglog);
        D.nsiglog = SIGNAL_LOG_MAX;
    }
    if (acted) {
        D.last_acted = now;
        D.acted_once = 1;
        D.sig_acted++;
        logmsg(L_INFO, "SIGUSR1: restarting all outgoing connections (re-resolving names)");
        for (int i = 0; i < D.npeers; i++) peer_restart(&D.peers[i]);
    } else {
        D.sig_ignored++;
        logmsg(L_INFO, "SIGUSR1 ignored: less than %.0f s since the last one acted on", D.usr1_window);
    }
    write_state();
}

static void on_hup(void) {
    sb peers = {0};
    sb_putc(&peers, '{');
    for (int i = 0; i < D.npeers; i++)
        sb_printf(&peers, "%s%d: '%s'", i ? ", " : "", D.peers[i].index, D.peers[i].status);
    sb_putc(&peers, '}');
    logmsg(L_INFO, "SIGHUP: state=%s node=%d peers=%s", D.state, D.node_id, peers.p);
    sb_free(&peers);
}

static void read_signals(void) {
    unsigned char sigs[64];
    ssize_t n;
    while ((n = read(sig_pipe[0], sigs, sizeof sigs)) > 0)
        for (ssize_t i = 0; i < n; i++) {
            int s = sigs[i];
            if (s == SIGTERM || s == SIGINT || s == SIGQUIT) D.stop = 1;
            else if (s == SIGUSR1) on_usr1();
            else if (s == SIGHUP) on_hup();
            /* SIGRTMIN: a lookup ended; dns_poll runs after every turn anyway */
        }
}

/* ------------------------------------------------------------------ the loop */

static double min_due(double a, double b) { return b < a ? b : a; }

/* milliseconds to the earliest deadline, rounded up (never a busy loop), -1: none */
static int poll_timeout(double now) {
    double due = D.next_tick;
    if (D.ready_pending) due = min_due(due, D.ready_due);
    for (int i = 0; i < D.npeers; i++) {
        peer *p = &D.peers[i];
        if (p->phase == PH_WAIT || p->phase == PH_CONNECT || p->phase == PH_HELLO) due = min_due(due, p->due);
    }
    for (int i = 0; i < D.ninc; i++)
        if (!D.inc[i]->greeted && !D.inc[i]->dead) due = min_due(due, D.inc[i]->hello_due);
    for (int i = 0; i < D.ncmd; i++)
        if (!D.cmd[i]->answered && !D.cmd[i]->dead) due = min_due(due, D.cmd[i]->due);
    if (isinf(due)) return -1;
    double ms = (due - now) * 1000.0;
    if (ms <= 0) return 0;
    return ms > 3600e3 ? 3600000 : (int)ms + 1;
}

static void run_timers(void) {
    double now = mono_now();
    if (now >= D.next_tick) keepalive();
    if (D.ready_pending && now >= D.ready_due) {
        D.ready_pending = 0;
        set_state(D.stuck_state ? D.stuck_state : "READY");
    }
    now = mono_now();
    for (int i = 0; i < D.npeers; i++) {
        peer *p = &D.peers[i];
        if ((p->phase == PH_WAIT || p->phase == PH_CONNECT || p->phase == PH_HELLO) && now >= p->due)
            peer_timer(p);
    }
    for (int i = 0; i < D.ninc; i++)
        if (!D.inc[i]->greeted && !D.inc[i]->dead && now >= D.inc[i]->hello_due) inc_close(D.inc[i], "no hello");
    for (int i = 0; i < D.ncmd; i++)
        if (!D.cmd[i]->answered && !D.cmd[i]->dead && now >= D.cmd[i]->due) cmd_failed(D.cmd[i], "");
}

/* free the connections that ended in this turn (their pointers were live until now) */
static void sweep(void) {
    int j = 0;
    for (int i = 0; i < D.ninc; i++)
        if (D.inc[i]->dead) free(D.inc[i]);
        else D.inc[j++] = D.inc[i];
    D.ninc = j;
    j = 0;
    for (int i = 0; i < D.ncmd; i++)
        if (D.cmd[i]->dead) free(D.cmd[i]);
        else D.cmd[j++] = D.cmd[i];
    D.ncmd = j;
}

/* One epoll event. A connection closed earlier in this batch is skipped (its struct lives
 * until sweep); none is reopened within a batch: signals are handled after it. */
static void on_event(conn *c, uint32_t ev) {
    if (c->kind == K_LISTEN) {
        accept_peers();
    } else if (c->kind == K_CMDLISTEN) {
        accept_cmds();
    } else if (c->fd < 0) {
        return;
    } else if (c->kind == K_PEER) {
        peer *p = c->owner;
        if (p->phase == PH_CONNECT) {
            if (ev & (EPOLLOUT | EPOLLERR | EPOLLHUP)) peer_connect_done(p);
            return;
        }
        if (ev & EPOLLOUT) {
            int err = conn_flush(&p->c);
            if (err) {
                peer_conn_ended(p, errno_text(err), err);
                return;
            }
        }
        if (ev & (EPOLLIN | EPOLLERR | EPOLLHUP)) peer_readable(p);
    } else if (c->kind == K_INC) {
        incoming *in = c->owner;
        if (ev & EPOLLOUT) {
            int err = conn_flush(&in->c);
            if (err) {
                inc_close(in, errno_text(err));
                return;
            }
        }
        if (ev & (EPOLLIN | EPOLLERR | EPOLLHUP)) inc_readable(in);
    } else if (c->kind == K_CMD) {
        cmdconn *k = c->owner;
        if (k->answered) { /* the reply is being written; then close */
            int err = conn_flush(&k->c);
            if (err || k->c.out.n == k->c.out_off || (ev & (EPOLLERR | EPOLLHUP))) cmd_close(k);
            return;
        }
        if (ev & (EPOLLIN | EPOLLERR | EPOLLHUP)) cmd_readable(k);
    }
}

/* every connection registered for what it waits on now: its connect, its input, and its
 * output while some is queued */
static void sync_watches(void) {
    for (int i = 0; i < D.npeers; i++) {
        peer *p = &D.peers[i];
        uint32_t ev = p->phase == PH_CONNECT ? EPOLLOUT : EPOLLIN | (p->c.out.n > p->c.out_off ? EPOLLOUT : 0);
        watch(&p->c, K_PEER, p, ev);
    }
    for (int i = 0; i < D.ninc; i++) {
        incoming *in = D.inc[i];
        watch(&in->c, K_INC, in, EPOLLIN | (in->c.out.n > in->c.out_off ? EPOLLOUT : 0));
    }
    for (int i = 0; i < D.ncmd; i++) watch(&D.cmd[i]->c, K_CMD, D.cmd[i], D.cmd[i]->answered ? EPOLLOUT : EPOLLIN);
}

static void event_loop(void) {
    static conn sig_c, listen_c, cmd_c; /* the fixed descriptors' places in the set */
    conn_init(&sig_c, sig_pipe[0]);
    conn_init(&listen_c, D.listen_fd);
    conn_init(&cmd_c, D.cmd_fd);
    watch(&sig_c, K_SIG, NULL, EPOLLIN);
    watch(&listen_c, K_LISTEN, NULL, EPOLLIN);
    watch(&cmd_c, K_CMDLISTEN, NULL, EPOLLIN);
    while (!D.stop) {
        sync_watches();
        struct epoll_event evs[64];
        int n = epoll_wait(epfd, evs, 64, poll_timeout(mono_now()));
        if (n < 0 && errno != EINTR) {
            logmsg(L_ERROR, "epoll_wait: %s", strerror(errno));
            D.stop = 1;
        }
        int signalled = 0;
        for (int i = 0; i < n; i++) {
            conn *c = evs[i].data.ptr;
            if (c->kind == K_SIG) signalled = 1;
            else on_event(c, evs[i].events);
        }
        if (signalled) read_signals();
        run_timers();
        if (D.dns) dns_poll();
        sweep();
        if (D.state_due) write_state_now(); /* once per turn, however many changes it made */
    }
}

/* ------------------------------------------------------------------ start and stop */

/* a listening socket on ip:port (SO_REUSEADDR); -1 with the Python's message */
static int listen_on(const char *ip, int port, sb *err) {
    struct sockaddr_storage sa;
    socklen_t len;
    int gai, one = 1;
    if (numeric_sockaddr(ip, port, &sa, &len, &gai)) {
        gai_error_text(err, gai, errno);
        return -1;
    }
    int fd = socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        os_error(err, errno, NULL);
        return -1;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (sa.ss_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&sa, len)) {
        int e = errno;
        char what[INET6_ADDRSTRLEN];
        sockaddr_text((struct sockaddr *)&sa, what, sizeof what);
        char *low = xstrdup(strerror(e));
        for (char *c = low; *c; c++)
            if (*c >= 'A' && *c <= 'Z') *c = (char)(*c - 'A' + 'a');
        sb_printf(err, "[Errno %d] error while attempting to bind on address ('%s', %d%s): %s", e, what,
                  port, sa.ss_family == AF_INET6 ? ", 0, 0" : "", low);
        free(low);
        close(fd);
        return -1;
    }
    if (listen(fd, 100)) {
        os_error(err, errno, NULL);
        close(fd);
        return -1;
    }
    return fd;
}

/* DAEMONIZE: the child listens; the parent waiting on the pipe may exit 0 now */
static void tell_parent(const char *msg) {
    if (D.daemon_pipe < 0) return;
    write_all(D.daemon_pipe, msg, strlen(msg));
    close(D.daemon_pipe);
    D.daemon_pipe = -1;
}

static int write_pid_file(sb *err) {
    char text[32];
    int n = snprintf(text, sizeof text, "%d\n", (int)getpid());
    int fd = open(D.pid_file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0 || write_all(fd, text, (size_t)n)) {
        os_error(err, errno, D.pid_file);
        if (fd >= 0) close(fd);
        return -1;
    }
    close(fd);
    return 0;
}

/* start(): listen, then every outgoing link; -1 with why ("cannot listen: ..." follows) */
static int start(sb *err) {
    D.listen_fd = listen_on(D.own_ip, D.cfg.server_port, err);
    if (D.listen_fd < 0) return -1;
    if (D.cfg.cmd_enabled) {
        D.cmd_fd = listen_on(*D.cfg.cmd_ip ? D.cfg.cmd_ip : "127.0.0.1", D.cfg.cmd_port, err);
        if (D.cmd_fd < 0) return -1;
    }
    alog_listening();
    logmsg(L_INFO, "node %d (%s) listening on %s:%d; %d peers", D.node_id, D.nodes.e[D.node_id], D.own_ip,
           D.cfg.server_port, D.npeers);
    set_state("WAITING_FOR_PEERS");
    D.last_tick = mono_now();
    D.next_tick = D.last_tick + PING_INTERVAL_S;
    for (int i = 0; i < D.npeers; i++) peer_restart(&D.peers[i]);
    return 0;
}

static void shutdown_daemon(void) {
    set_state("SHUTTING_DOWN");
    for (int i = 0; i < D.npeers; i++) peer_release(&D.peers[i]);
    if (D.listen_fd >= 0) close(D.listen_fd);
    if (D.cmd_fd >= 0) close(D.cmd_fd);
    D.listen_fd = D.cmd_fd = -1;
    for (int i = 0; i < D.ninc; i++)
        if (!D.inc[i]->dead) inc_close(D.inc[i], "connection closed");
    logmsg(L_INFO, "stopped");
    write_state_now();
}

/* The daemon (ImexStandin): set up, serve until SIGTERM, stop. 0, or 1 when it could not
 * start (said in the log, or to a waiting DAEMONIZE parent). */
static int run(void) {
    D.map_hash[0] = 0;
    nodes_hash(&D.nodes, D.map_hash);
    D.state = "INITIALIZING";
    D.listen_fd = D.cmd_fd = -1;
    D.alog_fd = -1;
    D.view_line_gen = -1;
    D.npeers = D.nodes.n - 1;
    D.peers = xcalloc((size_t)(D.npeers + 1) * sizeof *D.peers);
    long now = (long)wall_now();
    for (int i = 0, k = 0; i < D.nodes.n; i++) {
        if (i == D.node_id) continue;
        peer *p = &D.peers[k++];
        p->index = i;
        p->host = D.nodes.e[i];
        p->status = "NEVER_CONNECTED";
        p->changed = now;
        p->last_error = xstrdup("");
        p->c.fd = -1;
    }
    /* the handshake line, the same for every link */
    jv *hello = jnew(J_OBJ);
    jput(hello, "type", jstr("hello"));
    jput(hello, "node_id", jint(D.node_id));
    jput(hello, "map_hash", jstr(D.map_hash));
    jput(hello, "version", jstr(D.version));
    json_dump(&D.hello, hello, 0, 1);
    sb_putc(&D.hello, '\n');
    jfree(hello);
    int gai;
    if (numeric_sockaddr(D.own_ip, 0, &own_sa, &own_salen, &gai)) own_salen = 0;

    D.starts = previous_starts() + 1;
    D.started_at = wall_now();
    sb err = {0};
    if (D.attempt_log) {
        D.alog_fd = open(D.attempt_log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (D.alog_fd < 0) {
            os_error(&err, errno, D.attempt_log);
            goto failed;
        }
    }
    /* the loop takes signals from here on; the early SIGUSR1s are counted, not acted on */
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0 || pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK)) {
        os_error(&err, errno, NULL);
        goto failed;
    }
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGUSR1);
    sigprocmask(SIG_BLOCK, &block, &old);
    loop_running = 1;
    for (int i = 0; i < n_early && i < EARLY_MAX; i++) {
        D.sig_received++;
        D.sig_ignored++;
        siglog_add(early_usr1[i], 0, 1);
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    handle(SIGTERM), handle(SIGINT), handle(SIGQUIT), handle(SIGHUP), handle(SIGRTMIN);
    write_state();
    if (start(&err)) {
        if (D.state_due) write_state_now();
        goto failed;
    }
    if (D.daemon_pipe >= 0) { /* started(): the pid file, then the parent's "OK" */
        if (D.pid_file && write_pid_file(&err)) {
            write_state_now();
            goto failed;
        }
        tell_parent("OK\n");
    }
    /* _become_ready: it runs beside the links' first steps, before any of their I/O ends */
    if (D.stuck_state || !(D.ready_delay > 0)) {
        set_state(D.stuck_state ? D.stuck_state : "READY");
    } else if (!isinf(D.ready_delay)) {
        D.ready_pending = 1, D.ready_due = mono_now() + D.ready_delay;
    }
    event_loop();
    shutdown_daemon();
    return 0;
failed:
    if (D.daemon_pipe >= 0) {
        sb msg = {0};
        sb_printf(&msg, "nvidia-imex stand-in: cannot listen: %s\n", err.p);
        tell_parent(msg.p);
        sb_free(&msg);
    } else {
        logmsg(L_ERROR, "cannot listen: %s", err.p);
    }
    sb_free(&err);
    return 1;
}

/* _daemonize: fork like a Type=forking service; the parent exits once the child listens */
static int daemonize(void) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC)) return 1;
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid > 0) {
        close(fds[1]);
        sb msg = {0};
        char buf[4096];
        ssize_t r;
        while ((r = read(fds[0], buf, sizeof buf)) != 0) {
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) break;
            sb_add(&msg, buf, (size_t)r);
        }
        int ok = msg.n >= 2 && !memcmp(msg.p, "OK", 2);
        if (!ok) {
            const char *text = msg.n ? msg.p : "nvidia-imex stand-in failed\n";
            write_all(2, text, strlen(text));
        }
        sb_free(&msg);
        return ok ? 0 : 1;
    }
    close(fds[0]);
    setsid();
    if (fork() > 0) _exit(0);
    int devnull = open("/dev/null", O_RDWR);
    dup2(devnull, 0);
    if (*D.cfg.log_file) {
        dup2(devnull, 1);
        dup2(devnull, 2);
    }
    D.daemon_pipe = fds[1];
    _exit(run());
}

/* ------------------------------------------------------------------ the command line */
/* argparse's rules, as far as a caller can tell them apart: long options by unique prefix,
 * "--opt=value", "-cVALUE", "-vc VALUE", negative numbers as values, its messages. */

static const char USAGE[] =
    "usage: nvidia-imex (stand-in) [-h] [-c CONFIG] [--state-file STATE_FILE]\n"
    "                              [--pid-file PID_FILE]\n"
    "                              [--ready-delay READY_DELAY]\n"
    "                              [--stuck-state {INITIALIZING,STARTING_AUTH_SERVER,WAITING_FOR_PEERS,"
    "WAITING_FOR_RECOVERY,INIT_GPU,READY,SHUTTING_DOWN,UNAVAILABLE}]\n"
    "                              [--usr1-window USR1_WINDOW]\n"
    "                              [--version-string VERSION_STRING]\n"
    "                              [--attempt-log ATTEMPT_LOG] [-v] [--version]\n";

static const char HELP[] =
    "\n"
    "IMEX daemon stand-in for tests\n"
    "\n"
    "options:\n"
    "  -h, --help            show this help message and exit\n"
    "  -c CONFIG, --config CONFIG\n"
    "  --state-file STATE_FILE\n"
    "  --pid-file PID_FILE\n"
    "  --ready-delay READY_DELAY\n"
    "                        seconds in WAITING_FOR_PEERS before READY\n"
    "  --stuck-state {INITIALIZING,STARTING_AUTH_SERVER,WAITING_FOR_PEERS,WAITING_FOR_RECOVERY,"
    "INIT_GPU,READY,SHUTTING_DOWN,UNAVAILABLE}\n"
    "                        never reach READY; stay in this state\n"
    "  --usr1-window USR1_WINDOW\n"
    "                        SIGUSR1 rate limit in seconds (IMEX: 5)\n"
    "  --version-string VERSION_STRING\n"
    "  --attempt-log ATTEMPT_LOG\n"
    "                        append one JSON line per outgoing connection attempt\n"
    "                        (benchmarks)\n"
    "  -v, --verbose\n"
    "  --version             print \"IMEX version is: X\" as nvidia-imex --version\n"
    "                        does, and exit\n";

enum { A_HELP, A_CONFIG, A_STATE, A_PID, A_READY, A_STUCK, A_USR1, A_VERSTR, A_ALOG, A_VERBOSE, A_VERSION };
static const char *const ACT_NAME[] = {"-h/--help", "-c/--config", "--state-file", "--pid-file",
                                       "--ready-delay", "--stuck-state", "--usr1-window", "--version-string",
                                       "--attempt-log", "-v/--verbose", "--version"};
/* the option strings in the order argparse holds them (its ambiguity message's order) */
static const struct { const char *s; int act; } OPTS[] = {
    {"-h", A_HELP}, {"--help", A_HELP}, {"-c", A_CONFIG}, {"--config", A_CONFIG},
    {"--state-file", A_STATE}, {"--pid-file", A_PID}, {"--ready-delay", A_READY},
    {"--stuck-state", A_STUCK}, {"--usr1-window", A_USR1}, {"--version-string", A_VERSTR},
    {"--attempt-log", A_ALOG}, {"-v", A_VERBOSE}, {"--verbose", A_VERBOSE}, {"--version", A_VERSION}};
#define NOPTS (int)(sizeof OPTS / sizeof *OPTS)

static int takes_value(int act) { return act != A_HELP && act != A_VERBOSE && act != A_VERSION; }

__attribute__((noreturn, format(printf, 1, 2))) static void usage_error(const char *fmt, ...) {
    sb b = {0};
    sb_puts(&b, USAGE);
    sb_puts(&b, "nvidia-imex (stand-in): error: ");
    va_list ap;
    va_start(ap, fmt);
    sb_vprintf(&b, fmt, ap);
    va_end(ap);
    sb_putc(&b, '\n');
    write_all(2, b.p, b.n);
    exit(2);
}

static int find_opt(const char *s, size_t n) {
    for (int i = 0; i < NOPTS; i++)
        if (strlen(OPTS[i].s) == n && !strncmp(OPTS[i].s, s, n)) return i;
    return -1;
}

/* float(text), as Python parses it (underscores between digits, inf, nan); 0 if it refuses */
static int py_float(const char *text, double *out) {
    const char *s = text;
    size_t n = strlen(s);
    py_strip(&s, &n);
    char buf[256], *o = buf;
    if (!n || n >= sizeof buf) return 0;
    size_t i = 0;
    if (s[i] == '+' || s[i] == '-') *o++ = s[i++];
    const char *words[] = {"infinity", "inf", "nan"};
    for (int w = 0; w < 3; w++)
        if (n - i == strlen(words[w]) && !strncasecmp(s + i, words[w], n - i)) {
            *out = w < 2 ? (buf[0] == '-' ? -INFINITY : INFINITY) : NAN;
            return 1;
        }
    int digits = 0, dot = 0, exp = 0, exp_digits = 0;
    for (; i < n; i++) {
        char c = s[i];
        if (is_digit((unsigned char)c)) {
            *o++ = c;
            if (exp) exp_digits++;
            else digits++;
        } else if (c == '_' && i > 0 && is_digit((unsigned char)s[i - 1]) && i + 1 < n &&
                   is_digit((unsigned char)s[i + 1])) {
            continue;
        } else if (c == '.' && !dot && !exp) {
            *o++ = c, dot = 1;
        } else if ((c == 'e' || c == 'E') && !exp && digits) {
            *o++ = c, exp = 1;
            if (i + 1 < n && (s[i + 1] == '+' || s[i + 1] == '-')) *o++ = s[++i];
        } else {
            return 0;
        }
    }
    if (!digits || (exp && !exp_digits)) return 0;
    *o = 0;
    *out = strtod(buf, NULL);
    return 1;
}

static int is_negative_number(const char *a) { /* argparse's '^-\d+$|^-\d*\.\d+$' */
    if (a[0] != '-') return 0;
    const char *s = a + 1;
    while (is_digit((unsigned char)*s)) s++;
    if (!*s) return s > a + 1;
    if (*s != '.' || !is_digit((unsigned char)s[1])) return 0;
    for (s++; is_digit((unsigned char)*s); s++) {}
    return !*s;
}

/* _parse_optional: 0 for a positional, 1 for an option (*opt: its index in OPTS or -1 for
 * an unknown one; *explicit_arg: an attached value) */
static int classify(const char *a, int *opt, const char **explicit_arg) {
    *opt = -1;
    *explicit_arg = NULL;
    if (a[0] != '-') return 0;
    if ((*opt = find_opt(a, strlen(a))) >= 0) return 1;
    if (!a[1]) return 0;
    const char *eq = strchr(a, '=');
    if (eq && (*opt = find_opt(a, (size_t)(eq - a))) >= 0) {
        *explicit_arg = eq + 1;
        return 1;
    }
    int matches[NOPTS], nm = 0;
    const char *ex[NOPTS];
    if (a[1] == '-') {
        size_t plen = eq ? (size_t)(eq - a) : strlen(a);
        for (int i = 0; i < NOPTS; i++)
            if (!strncmp(OPTS[i].s, a, plen)) ex[nm] = eq ? eq + 1 : NULL, matches[nm++] = i;
    } else {
        for (int i = 0; i < NOPTS; i++) {
            if (strlen(OPTS[i].s) == 2 && !strncmp(OPTS[i].s, a, 2)) ex[nm] = a + 2, matches[nm++] = i;
            else if (!strncmp(OPTS[i].s, a, strlen(a))) ex[nm] = NULL, matches[nm++] = i;
        }
    }
    if (nm > 1) {
        sb list = {0};
        for (int i = 0; i < nm; i++) sb_printf(&list, "%s%s", i ? ", " : "", OPTS[matches[i]].s);
        usage_error("ambiguous option: %s could match %s", a, list.p);
    }
    if (nm == 1) {
        *opt = matches[0];
        *explicit_arg = ex[0];
        return 1;
    }
    *opt = -1;
    if (is_negative_number(a) || strchr(a, ' ')) return 0;
    return 1;
}

static int version_flag;

static void apply_opt(int act, const char *v) {
    sb r = {0};
    switch (act) {
    case A_HELP:
        fputs(USAGE, stdout);
        fputs(HELP, stdout);
        exit(0);
    case A_CONFIG: set_str(&D.config_path, NULL), D.config_path = py_path(v); break;
    case A_STATE: set_str(&D.state_file, NULL), D.state_file = py_path(v); break;
    case A_PID: set_str(&D.pid_file, NULL), D.pid_file = py_path(v); break;
    case A_ALOG: set_str(&D.attempt_log, NULL), D.attempt_log = py_path(v); break;
    case A_VERSTR: set_str(&D.version, v); break;
    case A_VERBOSE: log_verbose = 1; break;
    case A_VERSION: version_flag = 1; break;
    case A_READY:
    case A_USR1:
        if (!py_float(v, act == A_READY ? &D.ready_delay : &D.usr1_window)) {
            py_repr_str(&r, v, strlen(v));
            usage_error("argument %s: invalid float value: %s", ACT_NAME[act], r.p);
        }
        break;
    case A_STUCK:
        for (int i = 0; i < NSTATES; i++)
            if (!strcmp(v, STATES[i])) {
                D.stuck_state = STATES[i];
                return;
            }
        py_repr_str(&r, v, strlen(v));
        sb_puts(&r, " (choose from ");
        for (int i = 0; i < NSTATES; i++) sb_printf(&r, "%s'%s'", i ? ", " : "", STATES[i]);
        sb_putc(&r, ')');
        usage_error("argument --stuck-state: invalid choice: %s", r.p);
    }
    sb_free(&r);
}

static void parse_args(int argc, char **argv) {
    D.config_path = xstrdup(DEFAULT_CONFIG);
    D.version = xstrdup(DEFAULT_VERSION);
    D.usr1_window = USR1_WINDOW_S;
    int n = argc - 1, *opt = xcalloc(sizeof(int) * (size_t)(n + 1)), *isopt = xcalloc(sizeof(int) * (size_t)(n + 1));
    const char **ex = xcalloc(sizeof(char *) * (size_t)(n + 1));
    char **args = argv + 1;
    int dashdash = 0;
    for (int i = 0; i < n; i++) { /* classified first, as argparse does (ambiguity first) */
        if (dashdash || !strcmp(args[i], "--")) {
            dashdash = 1;
            continue;
        }
        isopt[i] = classify(args[i], &opt[i], &ex[i]);
    }
    sb extras = {0};
    int nextras = 0;
    for (int i = 0; i < n;) {
        if (!isopt[i] || opt[i] < 0) {
            sb_printf(&extras, "%s%s", nextras++ ? " " : "", args[i]);
            i++;
            continue;
        }
        int o = opt[i];
        const char *explicit_arg = ex[i], *optstr = OPTS[o].s;
        for (;;) {
            int act = OPTS[o].act;
            if (explicit_arg) {
                if (takes_value(act)) {
                    apply_opt(act, explicit_arg);
                    i++;
                    break;
                }
                sb r = {0};
                py_repr_str(&r, explicit_arg, strlen(explicit_arg));
                if (optstr[1] == '-' || !*explicit_arg)
                    usage_error("argument %s: ignored explicit argument %s", ACT_NAME[act], r.p);
                apply_opt(act, NULL); /* "-vc": -v, then -c with what follows */
                char next[3] = {'-', explicit_arg[0], 0};
                int o2 = find_opt(next, 2);
                if (o2 < 0) usage_error("argument %s: ignored explicit argument %s", ACT_NAME[act], r.p);
                sb_free(&r);
                o = o2;
                optstr = OPTS[o].s;
                explicit_arg = explicit_arg[1] ? explicit_arg + 1 : NULL;
                continue;
            }
            if (!takes_value(act)) {
                apply_opt(act, NULL);
                i++;
                break;
            }
            if (i + 1 >= n || isopt[i + 1] || !strcmp(args[i + 1], "--"))
                usage_error("argument %s: expected one argument", ACT_NAME[act]);
            apply_opt(act, args[i + 1]);
            i += 2;
            break;
        }
    }
    if (nextras) usage_error("unrecognized arguments: %s", sb_str(&extras));
    free(opt);
    free(isopt);
    free(ex);
}

/* ------------------------------------------------------------------ main */

/* prepare: the start-up checks IMEX does before it serves anything; 0, or -1 and why */
static int prepare(sb *err) {
    if (read_nodes(D.cfg.node_config_file, &D.nodes, err)) return -1;
    if (!D.nodes.n) {
        sb_printf(err, "node configuration file %s holds no nodes", D.cfg.node_config_file);
        return -1;
    }
    addrs_t local = {0};
    if (local_addresses(&local, err)) return -1;
    for (int i = 0; i < D.nodes.n; i++) {
        addrs_t got = {0};
        resolve_all(D.nodes.e[i], &got);
        for (int j = 0; j < got.n; j++) {
            int wanted = 0;
            if (*D.cfg.bind_ip) wanted = !strcmp(got.a[j], D.cfg.bind_ip);
            else
                for (int k = 0; k < local.n && !wanted; k++) wanted = !strcmp(got.a[j], local.a[k]);
            if (wanted) {
                D.node_id = i;
                D.own_ip = xstrdup(got.a[j]);
                addrs_free(&got);
                addrs_free(&local);
                return 0;
            }
        }
        addrs_free(&got);
    }
    addrs_free(&local);
    sb_puts(err, NO_MATCH_MESSAGE);
    return -1;
}

int main(int argc, char **argv) {
    /* A supervisor may signal the daemon moments after starting it: SIGUSR1's default action
     * would kill it. Such early signals are counted (as ignored) instead. */
    handle(SIGUSR1);
    signal(SIGPIPE, SIG_IGN);
    D.daemon_pipe = -1;
    tzset();
    parse_args(argc, argv);
    if (version_flag) {
        printf("IMEX version is: %s\n", D.version);
        return 0;
    }
    sb err = {0};
    if (load_config(D.config_path, &D.cfg, &err)) {
        fprintf(stderr, "nvidia-imex: %s\n", err.p);
        sb_free(&err);
        return 1;
    }
    if (*D.cfg.log_file) {
        log_fd = open(D.cfg.log_file, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0666);
        if (log_fd < 0) {
            sb why = {0};
            os_error(&why, errno, D.cfg.log_file);
            fprintf(stderr, "nvidia-imex: cannot open log file %s: %s\n", D.cfg.log_file, why.p);
            return 1;
        }
    }
    if (D.state_file) {
        sb tmp = {0};
        sb_printf(&tmp, "%s.tmp", D.state_file);
        D.state_tmp = tmp.p;
    }
    if (prepare(&err)) {
        logmsg(L_ERROR, "%s", err.p);
        if (*D.cfg.log_file) fprintf(stderr, "nvidia-imex: %s\n", err.p);
        sb_free(&err);
        return 1;
    }
    if (D.cfg.daemonize) return daemonize();
    if (D.pid_file && write_pid_file(&err)) {
        fprintf(stderr, "nvidia-imex: cannot write the pid file: %s\n", err.p);
        sb_free(&err);
        return 1;
    }
    return run();
}
