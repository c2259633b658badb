/* tools/elastic_log.c: what each attempt of a restarted job died of, and
 * the line that says the restarts are used up (tools/elastic.h). Kept
 * apart from the restart loops themselves, which only record and ask. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/elastic.h"

void tdm_elastic_log_add(tdm_elastic_log *l, const char *cause)
{
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 4;
        char **c = realloc(l->cause, (size_t)cap * sizeof *c);
        if (!c) return;   /* the line then lists fewer attempts: no reason to fail the job */
        l->cause = c;
        l->cap = cap;
    }
    l->cause[l->n] = strdup(cause && *cause ? cause : "failed (no reason given)");
    if (l->cause[l->n]) l->n++;
}

void tdm_elastic_log_used_up(const tdm_elastic_log *l, const char *tool, long long max_restarts)
{
    if (max_restarts <= 0 || l->n == 0) return;
    fprintf(stderr, "%s: the %lld restart%s %s used up, every attempt failed:", tool,
            max_restarts, max_restarts == 1 ? "" : "s", max_restarts == 1 ? "is" : "are");
    for (int i = 0; i < l->n; i++) {
        /* a long run of failures: the first and the last few */
        if (l->n > 2 * TDM_ELASTIC_LOG_SHOWN && i == TDM_ELASTIC_LOG_SHOWN) {
            fprintf(stderr, " (%d more);", l->n - 2 * TDM_ELASTIC_LOG_SHOWN);
            i = l->n - TDM_ELASTIC_LOG_SHOWN;
        }
        fprintf(stderr, " attempt %d: %s%s", i + 1, l->cause[i], i + 1 < l->n ? ";" : "\n");
    }
}

void tdm_elastic_log_free(tdm_elastic_log *l)
{
    for (int i = 0; i < l->n; i++) free(l->cause[i]);
    free(l->cause);
    memset(l, 0, sizeof *l);
}
