/* tools/doctor_job.c: the doctor's side of a job that tandem launches
 * (tandem launch, tandem train --mode ddp|fsdp): the dump directory and
 * TANDEM_FR_DUMP for the ranks, the launcher's summary (launch.json) and
 * the verdict printed after a failure (tools/doctor.h). Not the
 * diagnosis itself (tools/doctor.c). */
#include "tools/doctor.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "core/flight.h"
#include "core/safefile.h"
#include "shm/spawn.h"

/* JSON string for the summary (stdio is fine here: not a signal handler) */
static void tdm_doc_json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

int tdm_doctor_write_summary(const char *dir, const char *job, int world, const int *pid,
                             const int *wstatus, const int *induced, const char *cause)
{
    return tdm_doctor_write_summary_stalled(dir, job, world, pid, wstatus, induced, NULL, cause);
}

int tdm_doctor_write_summary_stalled(const char *dir, const char *job, int world,
                                     const int *pid, const int *wstatus, const int *induced,
                                     const int *stalled, const char *cause)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, TDM_DOCTOR_SUMMARY);
    tdm_file_out o;
    if (tdm_file_replace_open(&o, AT_FDCWD, path)) return -1;
    FILE *f = fdopen(dup(o.fd), "w");
    if (!f) { tdm_file_replace_abort(&o); return -1; }
    fprintf(f, "{\"version\":1,\"job\":");
    tdm_doc_json_str(f, job ? job : "");
    fprintf(f, ",\"world\":%d,\"cause\":", world);
    tdm_doc_json_str(f, cause ? cause : "");
    fprintf(f, ",\"ranks\":[");
    for (int r = 0; pid && wstatus && r < world; r++) {
        char end[128] = "";
        int ws = pid[r] > 0 ? wstatus[r] : -1;
        if (ws >= 0) tdm_shm_wait_status_str(ws, end, sizeof end);
        else if (pid[r] > 0) snprintf(end, sizeof end, "still running");
        fprintf(f, "%s{\"rank\":%d,\"pid\":%d,\"wstatus\":%d,\"induced\":%s,\"stalled\":%s,"
                "\"end\":", r ? "," : "", r, pid[r], ws, induced && induced[r] ? "true" : "false",
                stalled && stalled[r] ? "true" : "false");
        tdm_doc_json_str(f, end);
        fputc('}', f);
    }
    fprintf(f, "]}\n");
    int bad = fclose(f) != 0;
    if (bad) { tdm_file_replace_abort(&o); return -1; }
    return tdm_file_replace_commit(&o) ? -1 : 0;
}

/* A new job id for the ranks' dumps (TANDEM_JOB_ID, core/flight.h): the
 * doctor reads this job's dumps only, whatever else the directory holds
 * (an earlier attempt, another run, a planted file). */
static void tdm_doctor_job_id(tdm_doctor_job *j)
{
    uint64_t id = 0;
    if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        id = ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20);
    }
    snprintf(j->job, sizeof j->job, "%016llx", (unsigned long long)(id ? id : 1));
    const char *was = getenv(TDM_FR_ENV_JOB);
    j->had_job = was != NULL;
    if (was) snprintf(j->job_was, sizeof j->job_was, "%s", was);
    setenv(TDM_FR_ENV_JOB, j->job, 1);
}

static void tdm_doctor_job_restore_id(const tdm_doctor_job *j)
{
    if (j->had_job) setenv(TDM_FR_ENV_JOB, j->job_was, 1);
    else unsetenv(TDM_FR_ENV_JOB);
}

tdm_status tdm_doctor_job_begin(tdm_doctor_job *j, const char *tool, const char *dir_hint)
{
    memset(j, 0, sizeof *j);
    j->tool = tool;
    tdm_doctor_job_id(j);
    const char *user = getenv("TANDEM_FR_DUMP");
    if (user && *user) {
        /* the rule of --plot and --log-dir (core/safefile.h), before a
         * rank starts: the summary is written there and the verdict read
         * from there, so a directory another user can write to would let
         * them steer (or hang) this job's diagnosis */
        int fd = -1;
        tdm_status st = tdm_dir_open_safe(user, "TANDEM_FR_DUMP", 1, &fd);
        if (st) {
            fprintf(stderr, "%s: %s\n", tool, tdm_error_message());
            tdm_doctor_job_restore_id(j);
            return st == TDM_STATUS_INVALID_ARG ? TDM_STATUS_USAGE : st;
        }
        close(fd);
        snprintf(j->dir, sizeof j->dir, "%s", user);
        j->on = 1;
        return TDM_STATUS_OK;
    }
    if (dir_hint) {
        snprintf(j->dir, sizeof j->dir, "%s", dir_hint);
    } else {
        const char *tmp = getenv("TMPDIR");
        snprintf(j->dir, sizeof j->dir, "%s/tandem-fr-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(j->dir)) {
            fprintf(stderr, "%s: note: no flight-recorder dumps (mkdtemp %s: %s)\n", tool, j->dir,
                    strerror(errno));
            return TDM_STATUS_OK;
        }
        j->created = 1;
    }
    j->on = 1;
    j->set_env = 1;
    setenv("TANDEM_FR_DUMP", j->dir, 1);
    if (!getenv("TANDEM_FR_DUMP_ON")) {
        setenv("TANDEM_FR_DUMP_ON", "failure", 1);
        j->set_on = 1;
    }
    return TDM_STATUS_OK;
}

static void tdm_doctor_job_clean(tdm_doctor_job *j)
{
    DIR *dp = opendir(j->dir);
    if (!dp) return;
    struct dirent *de;
    int dfd = dirfd(dp);
    while ((de = readdir(dp))) {
        int r, len = 0;
        if ((sscanf(de->d_name, "fr_rank_%d%n", &r, &len) == 1 && len > 0) ||
            !strcmp(de->d_name, TDM_DOCTOR_SUMMARY))
            unlinkat(dfd, de->d_name, 0);
    }
    closedir(dp);
    rmdir(j->dir);   /* fails, keeping it, if anything else is there */
}

tdm_doctor_verdict tdm_doctor_job_end(tdm_doctor_job *j, int failed, int world, const int *pid,
                                      const int *wstatus, const int *induced, const char *cause)
{
    /* the next job (a restart) draws its own id */
    tdm_doctor_job_restore_id(j);
    if (!j->on) return TDM_DOCTOR_OK;
    /* the next job (a restart) picks its own directory */
    if (j->set_env) unsetenv("TANDEM_FR_DUMP");
    if (j->set_on) unsetenv("TANDEM_FR_DUMP_ON");
    if (!failed) {
        if (j->created) tdm_doctor_job_clean(j);
        return TDM_DOCTOR_OK;
    }
    tdm_doctor_write_summary_stalled(j->dir, j->job, world, pid, wstatus, induced,
                                     j->early_done ? j->stalled : NULL, cause);
    char line[1024];
    tdm_doctor_verdict v = tdm_doctor_diagnose(j->dir, NULL, line, sizeof line);
    /* the verdict printed while the teardown ran stands unless the ends
     * of the stopped ranks changed it */
    if (!j->early_done)
        fprintf(stderr, "%s: doctor: %s\n", j->tool, line);
    else if (strcmp(line, j->early))
        fprintf(stderr, "%s: doctor (after the teardown): %s\n", j->tool, line);
    if (j->created && tdm_doctor_dir_dumps(j->dir) == 0) {
        /* no rank dumped (none got as far, or the recorder is off): a
         * directory of ours with nothing to diagnose is not left behind */
        tdm_doctor_dir_remove(j->dir);
        return v;
    }
    fprintf(stderr, "%s: flight-recorder dumps in %s (tandem doctor %s for the diagnosis)\n",
            j->tool, j->dir, j->dir);
    if (j->created) {
        /* one directory per failed job: only the newest few stay */
        char parent[sizeof j->dir];
        snprintf(parent, sizeof parent, "%s", j->dir);
        char *slash = strrchr(parent, '/');
        if (slash && slash != parent) *slash = '\0';
        if (slash) tdm_doctor_dirs_prune(slash == parent ? "/" : parent);
    }
    return v;
}

void tdm_doctor_job_settled(const tdm_shm_watch *w, void *job)
{
    tdm_doctor_job *j = job;
    if (!j->on || j->early_done) return;
    int ws[TDM_SHM_MAX_RANKS], stopped[TDM_SHM_MAX_RANKS], ns = 0;
    for (int r = 0; r < w->world; r++) {
        ws[r] = w->ended[r] ? w->wstatus[r] : -1;
        if (w->pid[r] > 0 && !w->ended[r]) stopped[ns++] = r;
        j->stalled[r] = w->pid[r] > 0 && !w->ended[r];
    }
    char cause[1024] = "";
    if (tdm_shm_watch_blame(w, NULL) != TDM_STATUS_OK)
        snprintf(cause, sizeof cause, "%s", tdm_error_message());
    tdm_doctor_write_summary_stalled(j->dir, j->job, w->world, w->pid, ws, w->induced,
                                     j->stalled, cause[0] ? cause : NULL);
    tdm_doctor_diagnose(j->dir, NULL, j->early, sizeof j->early);
    j->early_done = 1;
    char who[256];
    size_t wl = (size_t)snprintf(who, sizeof who, "%s", ns > 1 ? "ranks " : "rank ");
    for (int i = 0; i < ns && wl < sizeof who; i++)
        wl += (size_t)snprintf(who + wl, sizeof who - wl, "%s%d", i ? "," : "", stopped[i]);
    fprintf(stderr, "%s: doctor: %s\n%s: %s %s stopped (no dump, no exit of %s own): the "
                    "teardown kills %s after its grace period\n", j->tool, j->early, j->tool,
            who, ns > 1 ? "are" : "is", ns > 1 ? "their" : "its", ns > 1 ? "them" : "it");
}

