/* Parsing of --trainmover[=OPTS]. Pure C: no Slurm calls, so that it can be tested alone
 * (tests/e2e/test_spank.py builds it with a small driver). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tm_spank.h"

#define TM_EXPECTED "expected a comma list of standbys=N (0-64) or auto, reservation=NAME"

void tm_opts_reset(struct tm_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->standbys = -1;
}

const char *tm_standbys_value(const struct tm_opts *o, char *buf, size_t len)
{
    if (o->standbys == TM_STANDBYS_AUTO)
        return "auto";
    if (o->standbys < 0)
        return NULL;
    snprintf(buf, len, "%d", o->standbys);
    return buf;
}

static int valid_name(const char *s, size_t n)
{
    if (n == 0 || n >= TM_MAX_NAME)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-' || c == '.'))
            return 0;
    }
    return 1;
}

static int parse_item(const char *item, size_t len, struct tm_opts *o, char *err, size_t errlen)
{
    const char *eq = memchr(item, '=', len);
    if (!eq) {
        snprintf(err, errlen, "unknown setting '%.*s' in --trainmover (" TM_EXPECTED ")", (int)len, item);
        return -1;
    }
    size_t klen = (size_t)(eq - item), vlen = len - klen - 1;
    const char *val = eq + 1;
    if (klen == 8 && strncmp(item, "standbys", 8) == 0) {
        char buf[16], *end = NULL;
        if (o->standbys != -1) {
            snprintf(err, errlen, "standbys given twice in --trainmover");
            return -1;
        }
        if (vlen == 4 && strncmp(val, "auto", 4) == 0) {
            o->standbys = TM_STANDBYS_AUTO;
            return 0;
        }
        if (vlen == 0 || vlen >= sizeof(buf) || val[0] < '0' || val[0] > '9') {
            snprintf(err, errlen, "standbys=%.*s: expected auto or a number from 0 to %d", (int)vlen, val,
                     TM_MAX_STANDBYS);
            return -1;
        }
        memcpy(buf, val, vlen);
        buf[vlen] = '\0';
        errno = 0;
        long n = strtol(buf, &end, 10);
        if (errno || *end != '\0' || n < 0 || n > TM_MAX_STANDBYS) {
            snprintf(err, errlen, "standbys=%s: expected auto or a number from 0 to %d", buf, TM_MAX_STANDBYS);
            return -1;
        }
        o->standbys = (int)n;
        return 0;
    }
    if (klen == 11 && strncmp(item, "reservation", 11) == 0) {
        if (o->reservation[0]) {
            snprintf(err, errlen, "reservation given twice in --trainmover");
            return -1;
        }
        if (!valid_name(val, vlen)) {
            snprintf(err, errlen, "reservation=%.*s: expected 1-%d characters of [A-Za-z0-9_.-]",
                     (int)(vlen > 80 ? 80 : vlen), val, TM_MAX_NAME - 1);
            return -1;
        }
        memcpy(o->reservation, val, vlen);
        o->reservation[vlen] = '\0';
        return 0;
    }
    snprintf(err, errlen, "unknown setting '%.*s' in --trainmover (" TM_EXPECTED ")",
             (int)(klen > 80 ? 80 : klen), item);
    return -1;
}

int tm_opts_parse(const char *arg, struct tm_opts *o, char *err, size_t errlen)
{
    struct tm_opts parsed;
    tm_opts_reset(&parsed);
    parsed.given = 1;
    if (arg && *arg) {
        const char *p = arg;
        for (;;) {
            const char *comma = strchr(p, ',');
            size_t len = comma ? (size_t)(comma - p) : strlen(p);
            if (len == 0) {
                snprintf(err, errlen, "empty setting in --trainmover=%s (" TM_EXPECTED ")", arg);
                return -1;
            }
            if (parse_item(p, len, &parsed, err, errlen) != 0)
                return -1;
            if (!comma)
                break;
            p = comma + 1;
        }
    }
    *o = parsed;
    return 0;
}
