/* tests/test_rpc_fuzz.c: malformed input on rpc/'s TCP port. A real
 * endpoint (rank 0 of a world of 2, in this process) faces a fake rank 1
 * written here with raw sockets: it says hello as a rank would, then
 * sends valid calls (answered), calls of unknown or unprintable names
 * (answered with an error), and malformed messages: each kind of bad
 * header field, and seeded random bytes. A malformed message costs the
 * sender its connection, and rank 0 names what was wrong in the error of
 * its next call to it; rank 0 itself never crashes and goes on serving.
 * Strangers that connect after set-up (garbage, a partial hello, a hello
 * claiming a connected rank, silence) are turned away while the real
 * peer's calls go on. Loopback (127.0.0.1) only. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/timer.h"
#include "rpc/rpc_impl.h"
#include "tests/timeout_util.h"

#define FUZZ_RANDOM_CASES 40

static int64_t bound_ms(void) { return tu_scaled_ms(20000); }

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t len = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &len);
    close(fd);
    return ntohs(a.sin_port);
}

static int connect_port(int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                            .sin_port = htons((uint16_t)port)};
    uint64_t t0 = tdm_time_ns();
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) return fd;
        close(fd);
        cr_assert_lt(tdm_time_ns() - t0, (uint64_t)bound_ms() * 1000000u, "nobody listens on %d", port);
        usleep(5000);
    }
}

static void write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t k = send(fd, b, n, MSG_NOSIGNAL);
        if (k <= 0) return;   /* the endpoint may close first: that is its answer */
        b += k;
        n -= (size_t)k;
    }
}

/* Reads n bytes; 0 when the connection ended first. */
static int read_all(int fd, void *p, size_t n)
{
    uint8_t *b = p;
    while (n) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        cr_assert_gt(poll(&pf, 1, (int)bound_ms()), 0, "no answer within the bound");
        ssize_t k = recv(fd, b, n, 0);
        if (k <= 0) return 0;
        b += k;
        n -= (size_t)k;
    }
    return 1;
}

static tdm_status fn_echo(tdm_rpc_req *req, void *ctx)
{
    (void)ctx;
    void *out = NULL;
    TDM_CHECK(tdm_rpc_req_reply(req, req->nbytes, &out));
    memcpy(out, req->args, req->nbytes);
    return TDM_STATUS_OK;
}

typedef struct endpoint {
    int port;
    tdm_rpc *rpc;
    tdm_status st;
    char err[TDM_ERROR_MSG_MAX];
    pthread_t th;
} endpoint;

static void *endpoint_main(void *arg)
{
    endpoint *e = arg;
    tdm_rpc_opts o = {.transport = TDM_RPC_TCP, .rank = 0, .world = 2, .master_addr = "127.0.0.1",
                      .master_port = e->port, .setup_ms = bound_ms(), .max_msg_bytes = 1 << 20};
    e->st = tdm_rpc_init(&e->rpc, &o);
    if (e->st == TDM_STATUS_OK) e->st = tdm_rpc_register(e->rpc, "echo", fn_echo, NULL);
    snprintf(e->err, sizeof e->err, "%s", tdm_error_message());
    return NULL;
}

/* Starts rank 0 and connects the fake rank 1 to it; returns its socket. */
static int start(endpoint *e)
{
    memset(e, 0, sizeof *e);
    e->port = free_port();
    cr_assert_eq(pthread_create(&e->th, NULL, endpoint_main, e), 0);
    int fd = connect_port(e->port);
    tdm_rpc_wire w;
    tdm_rpc_wire_fill(&w, TDM_RPC_KIND_HELLO, 1, 9 /* a port nobody uses: rank 0 never connects */, 2, 0, 0);
    write_all(fd, &w, sizeof w);
    uint8_t table[sizeof w + 16];
    cr_assert(read_all(fd, table, sizeof table), "no table from rank 0");
    pthread_join(e->th, NULL);
    cr_assert_eq(e->st, TDM_STATUS_OK, "%s", e->err);
    return fd;
}

static void frame(int fd, tdm_rpc_kind kind, uint64_t id, const char *name, const void *args, size_t n)
{
    tdm_rpc_wire w;
    uint32_t nl = (uint32_t)strlen(name);
    tdm_rpc_wire_fill(&w, kind, 1, 0, id, nl, nl + n);
    write_all(fd, &w, sizeof w);
    write_all(fd, name, nl);
    write_all(fd, args, n);
}

/* Reads one reply; returns its status, the body in body (NUL-ended). */
static int read_reply(int fd, uint64_t id, char *body, size_t cap)
{
    tdm_rpc_wire w;
    cr_assert(read_all(fd, &w, sizeof w), "rank 0 closed instead of answering");
    cr_assert_eq(w.magic, TDM_RPC_MAGIC);
    cr_assert_eq(w.kind, TDM_RPC_KIND_REPLY);
    cr_assert_eq(w.id, id);
    cr_assert_lt(w.body_len, cap);
    cr_assert(read_all(fd, body, (size_t)w.body_len));
    body[w.body_len] = '\0';
    return w.status;
}

/* The endpoint still serves: a call to itself, and a call to the fake
 * rank 1 fails naming why when the fake was cut off. */
static void still_serves(endpoint *e, const char *expect_in_error)
{
    char msg[] = "still here";
    void *rep = NULL;
    size_t n = 0;
    cr_assert_eq(tdm_rpc_call(e->rpc, 0, "echo", msg, sizeof msg, &rep, &n, bound_ms()), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    cr_assert(n == sizeof msg && !memcmp(rep, msg, n));
    free(rep);
    if (expect_in_error) {
        tdm_status st = tdm_rpc_call(e->rpc, 1, "echo", msg, sizeof msg, NULL, NULL, bound_ms());
        cr_assert_eq(st, TDM_STATUS_PEER_FAILED, "%s", tdm_error_message());
        cr_assert(strstr(tdm_error_message(), expect_in_error), "'%s' lacks '%s'", tdm_error_message(),
                  expect_in_error);
    }
}

/* Sends bytes as the fake rank 1, then expects to be cut off. */
static void expect_cut_off(const void *bytes, size_t n, const char *expect_in_error)
{
    endpoint e;
    int fd = start(&e);
    write_all(fd, bytes, n);
    char sink[256];
    uint64_t t0 = tdm_time_ns();
    for (;;) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        cr_assert_gt(poll(&pf, 1, (int)bound_ms()), 0, "rank 0 kept a peer that sent garbage");
        ssize_t k = recv(fd, sink, sizeof sink, 0);
        if (k <= 0) break;
        cr_assert_lt(tdm_time_ns() - t0, (uint64_t)bound_ms() * 1000000u);
    }
    /* the reader marks the peer gone as it closes the connection */
    still_serves(&e, expect_in_error);
    close(fd);
    tdm_rpc_free(e.rpc);
}

static tdm_rpc_wire good_call(void)
{
    tdm_rpc_wire w;
    tdm_rpc_wire_fill(&w, TDM_RPC_KIND_CALL, 1, 0, 1, 4, 4 + 3);
    return w;
}

Test(rpc_fuzz, valid_calls_and_unknown_names_are_answered, .timeout = 60)
{
    endpoint e;
    int fd = start(&e);
    char body[512];
    frame(fd, TDM_RPC_KIND_CALL, 7, "echo", "abc", 3);
    cr_assert_eq(read_reply(fd, 7, body, sizeof body), TDM_STATUS_OK);
    cr_assert_str_eq(body, "abc");
    frame(fd, TDM_RPC_KIND_CALL, 8, "nope", "abc", 3);
    cr_assert_eq(read_reply(fd, 8, body, sizeof body), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(body, "no function named 'nope' is registered on rank 0"), "%s", body);
    frame(fd, TDM_RPC_KIND_CALL, 9, "\x01\xff\x7f", NULL, 0);
    cr_assert_eq(read_reply(fd, 9, body, sizeof body), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(body, "no function named '\?\?\?'"), "%s", body);
    /* a name with a NUL inside is no registered name either */
    tdm_rpc_wire w;
    tdm_rpc_wire_fill(&w, TDM_RPC_KIND_CALL, 1, 0, 10, 5, 5);
    write_all(fd, &w, sizeof w);
    write_all(fd, "echo\0", 5);
    cr_assert_eq(read_reply(fd, 10, body, sizeof body), TDM_STATUS_INVALID_ARG);
    /* a reply to no call is dropped; the connection stays */
    frame(fd, TDM_RPC_KIND_REPLY, 12345, "", "zz", 2);
    frame(fd, TDM_RPC_KIND_CALL, 11, "echo", "xyz", 3);
    cr_assert_eq(read_reply(fd, 11, body, sizeof body), TDM_STATUS_OK);
    cr_assert_str_eq(body, "xyz");
    still_serves(&e, NULL);
    close(fd);
    tdm_rpc_free(e.rpc);
}

Test(rpc_fuzz, each_bad_header_field_cuts_the_sender_off, .timeout = 120)
{
    struct {
        const char *what, *expect;
        void (*spoil)(tdm_rpc_wire *);
    } cases[] = {
        {"magic", "bad magic", NULL},
        {"version", "protocol version", NULL},
        {"kind 0", "unknown message kind 0", NULL},
        {"kind 99", "unknown message kind 99", NULL},
        {"src", "says it is from rank 0", NULL},
        {"reserved", "reserved field", NULL},
        {"body_len", "over the limit", NULL},
        {"name_len", "name of 64 bytes", NULL},
        {"name_len > body", "name of 7 bytes", NULL},
        {"no name", "without a function name", NULL},
        {"status", "not a status", NULL},
        {"hello", "a hello after", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tdm_rpc_wire w = good_call();
        switch (i) {
        case 0: w.magic ^= 0x01000000u; break;
        case 1: w.version = 77; break;
        case 2: w.kind = 0; break;
        case 3: w.kind = 99; break;
        case 4: w.src = 0; break;
        case 5: w.reserved = 1; break;
        case 6: w.body_len = (uint64_t)1 << 40; break;
        case 7: w.name_len = 64; w.body_len = 80; break;
        case 8: w.name_len = 7; w.body_len = 3; break;
        case 9: w.name_len = 0; break;
        case 10: w.kind = TDM_RPC_KIND_REPLY; w.status = 999; break;
        case 11: w.kind = TDM_RPC_KIND_HELLO; break;
        }
        uint8_t buf[sizeof w + 7];
        memcpy(buf, &w, sizeof w);
        memcpy(buf + sizeof w, "echoabc", 7);
        cr_log_info("case %zu: %s", i, cases[i].what);
        expect_cut_off(buf, sizeof buf, cases[i].expect);
    }
}

Test(rpc_fuzz, random_bytes_never_crash_the_callee, .timeout = 180)
{
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    for (int c = 0; c < FUZZ_RANDOM_CASES; c++) {
        uint8_t buf[200];
        size_t n = 1 + (size_t)(c * 37 % 199);
        for (size_t i = 0; i < n; i++) {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            buf[i] = (uint8_t)seed;
        }
        /* half the cases keep a valid magic, so that later fields are
         * what gets checked */
        if (c % 2 && n >= 4) {
            uint32_t m = TDM_RPC_MAGIC;
            memcpy(buf, &m, 4);
        }
        if (n >= sizeof(tdm_rpc_wire)) {
            expect_cut_off(buf, n, "sent a malformed message");
        } else {
            /* fewer bytes than a header, then the end: a peer that went */
            endpoint e;
            int fd = start(&e);
            write_all(fd, buf, n);
            close(fd);
            uint64_t t0 = tdm_time_ns();
            tdm_status st;
            while ((st = tdm_rpc_call(e.rpc, 1, "echo", NULL, 0, NULL, NULL, 50)) == TDM_STATUS_TIMEOUT)
                cr_assert_lt(tdm_time_ns() - t0, (uint64_t)bound_ms() * 1000000u);
            cr_assert_eq(st, TDM_STATUS_PEER_FAILED, "%s", tdm_error_message());
            cr_assert(strstr(tdm_error_message(), "closed its connection"), "%s", tdm_error_message());
            still_serves(&e, NULL);
            tdm_rpc_free(e.rpc);
        }
    }
}

Test(rpc_fuzz, strangers_after_setup_are_turned_away, .timeout = 60)
{
    endpoint e;
    int fd = start(&e);
    int strangers[6];
    tdm_rpc_wire hello;
    tdm_rpc_wire_fill(&hello, TDM_RPC_KIND_HELLO, 1, 5555, 2, 0, 0);
    for (int i = 0; i < 6; i++) {
        strangers[i] = connect_port(e.port);
        switch (i) {
        case 0: write_all(strangers[i], "GET / HTTP/1.0\r\n\r\n", 18); break;
        case 1: write_all(strangers[i], &hello, 20); break;          /* partial, then silence */
        case 2: write_all(strangers[i], &hello, sizeof hello); break; /* rank 1 again */
        case 3: break;                                                /* silence */
        case 4: write_all(strangers[i], "\x54\x52\x50\x43", 4); break; /* a magic alone */
        case 5: close(strangers[i]); strangers[i] = -1; break;
        }
    }
    /* the garbage and the duplicate are closed by rank 0 */
    static const int closed_by_rank0[] = {0, 2};
    for (size_t j = 0; j < 2; j++) {
        char sink[64];
        int s = strangers[closed_by_rank0[j]];
        struct pollfd pf = {.fd = s, .events = POLLIN};
        cr_assert_gt(poll(&pf, 1, (int)bound_ms()), 0, "stranger %d was not turned away", closed_by_rank0[j]);
        cr_assert_leq(recv(s, sink, sizeof sink, 0), 0);
    }
    /* meanwhile the real peer's calls go on */
    char body[64];
    for (uint64_t id = 1; id <= 20; id++) {
        frame(fd, TDM_RPC_KIND_CALL, id, "echo", "ok", 2);
        cr_assert_eq(read_reply(fd, id, body, sizeof body), TDM_STATUS_OK);
        cr_assert_str_eq(body, "ok");
    }
    void *rep = NULL;
    size_t n = 0;
    tdm_rpc_future *f = NULL;
    /* and rank 0 calls rank 1 (the fake answers by hand) */
    cr_assert_eq(tdm_rpc_call_async(e.rpc, 1, "anything", "q", 1, &f), TDM_STATUS_OK);
    tdm_rpc_wire w;
    cr_assert(read_all(fd, &w, sizeof w));
    cr_assert_eq(w.kind, TDM_RPC_KIND_CALL);
    uint8_t in[64];
    cr_assert(read_all(fd, in, (size_t)w.body_len));
    tdm_rpc_wire r;
    tdm_rpc_wire_fill(&r, TDM_RPC_KIND_REPLY, 1, 0, w.id, 0, 3);
    write_all(fd, &r, sizeof r);
    write_all(fd, "yes", 3);
    cr_assert_eq(tdm_rpc_future_wait(f, bound_ms(), &rep, &n), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert(n == 3 && !memcmp(rep, "yes", 3));
    free(rep);
    tdm_rpc_future_free(f);
    for (int i = 0; i < 6; i++)
        if (strangers[i] >= 0) close(strangers[i]);
    close(fd);
    tdm_rpc_free(e.rpc);
}
