/* tools/doctor_impl.h: what the files of `tandem doctor` share: a job's
 * dumps as read and checked (tools/doctor_read.c), for the diagnosis
 * (tools/doctor.c). Internal to tools/. */
#ifndef TDM_TOOLS_DOCTOR_IMPL_H
#define TDM_TOOLS_DOCTOR_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "core/json.h"

/* Ranks a job may have (a dump claiming more is not read). */
#define TDM_DOC_MAX_RANKS 1024
/* The largest dump read: about 250,000 entries (TANDEM_FR_SIZE); a file
 * beyond it is refused unread (a planted 3 GB file must not be read
 * whole, nor its tree built). */
#define TDM_DOC_MAX_FILE_BYTES ((size_t)64 << 20)
/* Every file of the directory together. */
#define TDM_DOC_MAX_TOTAL_BYTES ((size_t)512 << 20)
/* Sequence numbers, steps and counts beyond 2^53 cannot come from the
 * recorder (a double's exact integers: any JSON reader may hold them). */
#define TDM_DOC_MAX_COUNT ((int64_t)1 << 53)

typedef struct tdm_doc_entry {
    uint64_t seq, count;
    int64_t root, step;
    const char *coll, *dtype, *op, *label, *state, *status;   /* cleaned, in the doc */
    uint64_t t_enq, t_start, t_end;
} tdm_doc_entry;

typedef struct tdm_doc_rank {
    int have;
    int unusable;                   /* its file was there but left out (a note says why) */
    tdm_json *doc;
    int failed;
    const char *reason, *status, *trigger;
    int64_t last_step, pid;
    uint64_t next_seq, first_seq;   /* entries hold seqs [first_seq, next_seq) */
    int n;
    tdm_doc_entry *e;               /* (n), by seq, no seq twice */
    uint64_t last_activity;         /* latest time stamp of any entry */
} tdm_doc_rank;

typedef struct tdm_doc {
    int world;
    tdm_doc_rank *r;                /* (world) */
    tdm_json *summary;              /* launch.json, checked; NULL: none */
    const char *cause;              /* summary's cause, or NULL */
    int skipped;                    /* files not read, each with a note */
    int other_job;                  /* of which dumps of another job */
    char job[24];                   /* the job read ("": dumps without an id) */
    char notes[2048];               /* "  note: ..." lines */
    size_t nl;
} tdm_doc;

/* Reads DIR's dumps and summary into d: each file checked (an object of
 * the recorder's shape, numbers in range, the rank its name says, no seq
 * twice, at most TDM_DOC_MAX_FILE_BYTES), every string cleaned of control
 * characters (a terminal must not take a dump's text for its own), and a
 * note for each file left out. Returns the number of dumps kept, -1 when
 * DIR cannot be opened. */
int tdm_doc_read(tdm_doc *d, const char *dir);
void tdm_doc_free(tdm_doc *d);

/* "all_reduce(float32, sum, count=48) 'ddp bucket 1'" (tools/doctor.c). */
void tdm_doc_call_str(const tdm_doc_entry *e, char *out, size_t n);
/* The collective the ranks waited in on the communicators split from the
 * job's first one (tools/doctor_sub.c): of the dumps of job (NULL: any)
 * of a split communicator that blamed (-1: any) belongs to, other than
 * blamed's own, the first call not done of each, the earliest started:
 * "all_reduce(...) 'label' #8 of the communicator of ranks 4,5 (...)"
 * in out. Returns 1 when there is one. */
int tdm_doc_sub_wait(const char *dir, const char *job, int blamed, char *out, size_t n);
/* Where rank stopped on those communicators: its first call not done
 * there (sends and receives too), the earliest started, in out
 * ("recv(...) 'pp recv act mb 0 stage 0->1' #8 of the communicator of
 * ranks 2,3 (...)"). Returns 1 when there is one. */
int tdm_doc_sub_stop(const char *dir, const char *job, int rank, char *out, size_t n);

/* The value of o's key k: a string (else dflt) / an integer or a boolean
 * (else dflt). */
const char *tdm_doc_str(const tdm_json *o, const char *k, const char *dflt);
int64_t tdm_doc_int(const tdm_json *o, const char *k, int64_t dflt);

#endif
