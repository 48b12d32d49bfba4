/* Test stand-in for nvidia-imex-ctl, asking the IMEX daemon stand-in
 * (tests/sandbox/imex_standin.py) over its command port: -q, -N [-j], -c CONFIG,
 * -i IP PORT, as FACTS.md describes the real one. The sandbox runs it on the host, and
 * the VM images carry it built static for the guest's architecture (ctl_build.py).
 *
 * Why C (issue 27): the guest agent execs nvidia-imex-ctl as a separate program for every
 * query, as it does the real one, which is a small native binary. A Python stand-in cost
 * ~50-70 ms of CPU per query in interpreter start alone, and a shell reading a socket
 * reads it a byte per system call (~60 ms for an 18-node -N -j); in the 18-VM sandbox that
 * was charged to the guests. Built by tests/sandbox/ctl_build.py with the system's gcc.
 *
 * Exit status: 0; 1 with "nvidia-imex-ctl: ..." on stderr and nothing on stdout when the
 * daemon cannot be asked or the config cannot be read; 2 for bad usage.
 */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define TIMEOUT_MS 3000
#define DEFAULT_CONFIG "/etc/nvidia-imex/config.cfg"

static void die(int code, const char *fmt, ...) {
    va_list ap;
    fputs(code == 2 ? "nvidia-imex-ctl (stand-in): " : "nvidia-imex-ctl: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(code);
}

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t' || *s == '\r' || *s == '\n') s++;
    char *e = s + strlen(s);
    while (e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r' || e[-1] == '\n')) *--e = 0;
    return s;
}

static int all_digits(const char *s) {
    if (!*s) return 0;
    for (; *s; s++) if (*s < '0' || *s > '9') return 0;
    return 1;
}

/* IMEX_CMD_BIND_INTERFACE_IP / IMEX_CMD_PORT from config.cfg */
static void read_config(const char *path, char *ip, size_t iplen, char *port, size_t plen) {
    FILE *f = fopen(path, "r");
    if (!f) die(1, "cannot read %s: %s", path, strerror(errno));
    char line[4096];
    while (fgets(line, sizeof line, f)) {
        char *l = trim(line);
        char *eq = strchr(l, '=');
        if (*l == '#' || !eq) continue;
        *eq = 0;
        char *key = trim(l), *value = trim(eq + 1);
        if (!strcmp(key, "IMEX_CMD_PORT")) snprintf(port, plen, "%s", value);
        else if (!strcmp(key, "IMEX_CMD_BIND_INTERFACE_IP")) snprintf(ip, iplen, "%s", value);
    }
    fclose(f);
}

static int connect_to(const char *ip, const char *port) {
    struct addrinfo hints = {0}, *res, *ai;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(ip, port, &hints, &res) != 0)
        die(1, "cannot connect to the IMEX daemon at %s:%s: no such address", ip, port);
    int fd = -1, err = 0;
    for (ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) { err = errno; continue; }
        int flags = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, flags | O_NONBLOCK);
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) break;
        if (errno == EINPROGRESS) {
            struct pollfd p = {fd, POLLOUT, 0};
            socklen_t len = sizeof err;
            if (poll(&p, 1, TIMEOUT_MS) == 1 &&
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) break;
            if (err == 0) err = ETIMEDOUT;
        } else {
            err = errno;
        }
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) die(1, "cannot connect to the IMEX daemon at %s:%s: %s", ip, port, strerror(err));
    return fd;
}

/* one request, one JSON line back (without its newline); the caller frees it */
static char *ask(const char *ip, const char *port, const char *cmd) {
    int fd = connect_to(ip, port);
    char req[64];
    int n = snprintf(req, sizeof req, "{\"cmd\":\"%s\"}\n", cmd);
    struct pollfd p = {fd, POLLOUT, 0};
    if (poll(&p, 1, TIMEOUT_MS) != 1 || write(fd, req, n) != n)
        die(1, "cannot connect to the IMEX daemon at %s:%s: write failed", ip, port);
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    if (!buf) die(1, "out of memory");
    for (;;) {
        p.events = POLLIN;
        if (poll(&p, 1, TIMEOUT_MS) != 1) die(1, "bad reply from the IMEX daemon at %s:%s: "
                                                 "no answer", ip, port);
        if (cap - len < 4096 && !(buf = realloc(buf, cap *= 2))) die(1, "out of memory");
        ssize_t got = read(fd, buf + len, cap - len - 1);
        if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (got <= 0) break;
        len += (size_t)got;
        if (memchr(buf + len - got, '\n', (size_t)got)) break;
    }
    close(fd);
    buf[len] = 0;
    char *nl = strchr(buf, '\n');
    if (nl) *nl = 0;
    if (buf[0] != '{') die(1, "bad reply from the IMEX daemon at %s:%s: not an object", ip, port);
    return buf;
}

/* the JSON string value of "key" in a flat reply, decoded; NULL when absent */
static char *string_field(const char *json, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *s = strstr(json, pat);
    if (!s) return NULL;
    s += strlen(pat);
    while (*s == ' ') s++;
    if (*s++ != '"') return NULL;
    char *out = malloc(strlen(s) * 3 + 1), *o = out;
    if (!out) die(1, "out of memory");
    for (; *s && *s != '"'; s++) {
        if (*s != '\\') { *o++ = *s; continue; }
        switch (*++s) {
            case 'n': *o++ = '\n'; break;
            case 't': *o++ = '\t'; break;
            case 'r': *o++ = '\r'; break;
            case 'b': *o++ = '\b'; break;
            case 'f': *o++ = '\f'; break;
            case 'u': {
                unsigned c = 0;
                for (int i = 1; i <= 4 && s[i]; i++)
                    c = c * 16 + (unsigned)(s[i] <= '9' ? s[i] - '0' : (s[i] | 32) - 'a' + 10);
                s += 4;
                if (c < 0x80) *o++ = (char)c;
                else if (c < 0x800) { *o++ = (char)(0xC0 | c >> 6); *o++ = (char)(0x80 | (c & 63)); }
                else { *o++ = (char)(0xE0 | c >> 12); *o++ = (char)(0x80 | (c >> 6 & 63));
                       *o++ = (char)(0x80 | (c & 63)); }
                break;
            }
            case 0: s--; break;
            default: *o++ = *s;
        }
    }
    *o = 0;
    return out;
}

static char *checked(const char *ip, const char *port, const char *cmd) {
    char *reply = ask(ip, port, cmd);
    if (!strncmp(reply, "{\"error\":", 9)) {
        char *msg = string_field(reply, "error");
        die(1, "IMEX daemon: %s", msg ? msg : reply);
    }
    return reply;
}

int main(int argc, char **argv) {
    int q = 0, nodes = 0, json = 0;
    const char *cfg = NULL, *ip_arg = NULL, *port_arg = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-q")) q = 1;
        else if (!strcmp(a, "-N")) nodes = 1;
        else if (!strcmp(a, "-j")) json = 1;
        else if (!strcmp(a, "-Nj") || !strcmp(a, "-jN")) nodes = json = 1;
        else if (!strcmp(a, "-c")) {
            if (i + 1 >= argc) die(2, "-c: expected one argument");
            cfg = argv[++i];
        } else if (!strcmp(a, "-i")) {
            if (i + 2 >= argc) die(2, "-i: expected 2 arguments");
            ip_arg = argv[++i];
            port_arg = argv[++i];
            if (!all_digits(port_arg)) die(2, "-i: port '%s' is not a number", port_arg);
        } else {
            die(2, "unrecognized arguments: %s", a);
        }
    }
    if (!q && !nodes) die(2, "one of -q or -N is required");
    char ip[256] = "127.0.0.1", port[64] = "50005";
    if (ip_arg) {
        snprintf(ip, sizeof ip, "%s", ip_arg);
        snprintf(port, sizeof port, "%d", atoi(port_arg));
    } else {
        struct stat st;
        const char *path = cfg ? cfg : DEFAULT_CONFIG;
        if (cfg || stat(path, &st) == 0) {
            char cip[256] = "", cport[64] = "";
            read_config(path, cip, sizeof cip, cport, sizeof cport);
            if (*cip) snprintf(ip, sizeof ip, "%s", cip);
            if (*cport) snprintf(port, sizeof port, "%s", cport);
        }
        long n = all_digits(port) ? strtol(port, NULL, 10) : 0;
        if (n < 1 || n > 65535) die(1, "IMEX_CMD_PORT='%s': not a port number", port);
        snprintf(port, sizeof port, "%ld", n);
    }
    if (q) {
        char *reply = checked(ip, port, "state");
        char *state = string_field(reply, "state");
        if (!state) die(1, "'state'");
        printf("%s\n", state);
    } else if (json) {
        printf("%s\n", checked(ip, port, "nodes"));
    } else {
        char *table = string_field(checked(ip, port, "table"), "table");
        if (!table) die(1, "'table'");
        printf("%s\n", table);
    }
    return 0;
}
