/* ds4's cold lookup, reimplemented from its description (issue 12), as the
 * baseline of benches/bench_index.py: what ds4_kvstore.c does when a server
 * starts and the first prompt arrives.
 *
 *   open:   rescan the directory; for every "<40 hex>.kv", open it and read
 *           its 52-byte header (magic "KVC", tokens at 8, text_bytes at 48).
 *   lookup: find_text_prefix: files in directory order; a file is hashed
 *           only when it could beat the best match so far (longer text, or
 *           as long with more tokens): SHA-1 of the prompt's prefix of its
 *           length against its name.
 *
 * SHA-1 is OpenSSL's (SHA extensions when the CPU has them), which is no
 * slower than ds4's own: the baseline is not handicapped.
 *
 *   ds4_find_prefix DIR PROMPT_FILE  ->  "open_ms lookup_ms best_len n_files n_hashed"
 */
#include <dirent.h>
#include <fcntl.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct ent { unsigned char digest[20]; uint32_t tokens, text_bytes; };

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static int parse_name(const char *n, unsigned char *d) {
    if (strlen(n) != 43 || strcmp(n + 40, ".kv") != 0) return 0;
    for (int i = 0; i < 20; i++) {
        int hi = hexval(n[2 * i]), lo = hexval(n[2 * i + 1]);
        if (hi < 0 || lo < 0) return 0;
        d[i] = (unsigned char)(hi << 4 | lo);
    }
    return 1;
}

static uint32_t le32(const unsigned char *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s DIR PROMPT_FILE\n", argv[0]); return 2; }
    FILE *pf = fopen(argv[2], "rb");
    if (!pf) { perror(argv[2]); return 1; }
    fseek(pf, 0, SEEK_END);
    long plen = ftell(pf);
    fseek(pf, 0, SEEK_SET);
    unsigned char *prompt = malloc(plen ? plen : 1);
    if (fread(prompt, 1, plen, pf) != (size_t)plen) { perror("read"); return 1; }
    fclose(pf);

    double t0 = now_ms();
    DIR *dir = opendir(argv[1]);
    if (!dir) { perror(argv[1]); return 1; }
    int dfd = dirfd(dir);
    size_t cap = 1024, n = 0;
    struct ent *es = malloc(cap * sizeof *es);
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        struct ent e;
        if (!parse_name(de->d_name, e.digest)) continue;
        int fd = openat(dfd, de->d_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) continue;
        unsigned char h[52];
        ssize_t got = pread(fd, h, sizeof h, 0);
        close(fd);
        if (got != (ssize_t)sizeof h || memcmp(h, "KVC", 3) != 0) continue;
        e.tokens = le32(h + 8);
        e.text_bytes = le32(h + 48);
        if (n == cap) es = realloc(es, (cap *= 2) * sizeof *es);
        es[n++] = e;
    }
    closedir(dir);
    double t1 = now_ms();

    struct ent *best = NULL;
    size_t hashed = 0;
    for (size_t i = 0; i < n; i++) {
        struct ent *e = &es[i];
        if (e->text_bytes > (uint64_t)plen) continue;
        if (best && !(e->text_bytes > best->text_bytes ||
                      (e->text_bytes == best->text_bytes && e->tokens > best->tokens)))
            continue;
        unsigned char md[20];
        SHA1(prompt, e->text_bytes, md);
        hashed++;
        if (memcmp(md, e->digest, 20) == 0) best = e;
    }
    double t2 = now_ms();
    printf("%.3f %.3f %u %zu %zu\n", t1 - t0, t2 - t1, best ? best->text_bytes : 0, n, hashed);
    free(es);
    free(prompt);
    return 0;
}
