/* The decode step's own threads (llama_step.c): workers that spin while a step runs and sleep between
   steps, sharing out each parallel part of the step: each thread runs its own share of the part's
   items in order and then takes what is left of the others' shares, so a thread slowed by the
   machine does less rather than holding the others at the part's end (an item is computed the
   same way whoever runs it).

   Why not OpenMP: the engine runs its steps on its scheduler thread, and a thread other than the
   one that first ran an OpenMP region gets a team of its own; with more OpenMP threads in the process
   than CPUs, libgomp stops spinning idle threads and wakes them through the kernel at every region.
   A step of the embedded model on two threads then took 18-19 ms against 15-16 on one (and 9.7 on
   the first thread). Here the workers spin only while a step holds the pool, so a step's ~150
   parallel parts each cost a few atomic operations. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "block_kernels.h"

#define MAX_WORKERS 63 /* a team fits the ticket's low 8 bits */

typedef struct { /* the next item of one thread's share: a cache line each, so claims do not contend */
    _Alignas(64) atomic_llong next;
    int64_t stop;
} share_t;

static struct {
    pthread_mutex_t held;     /* one step at a time owns the pool; others run on their own thread */
    pthread_mutex_t lock;     /* with wake: workers sleep here between steps */
    pthread_cond_t wake;
    atomic_int active;        /* a step holds the pool: workers spin */
    atomic_uint ticket;       /* each part's number (upper bits) and team (low 8 bits), read as one */
    atomic_int done;          /* workers finished with the current part */
    part_fn fn;
    void *context;
    int workers;
    share_t shares[MAX_WORKERS + 1]; /* the current part's */
    unsigned start_ticket;    /* the ticket when a worker was created: it waits for the next */
    pid_t owner;              /* the process the workers run in (a forked child has none) */
} pool = {.held = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

/* this thread's share item by item, then what is left of the others' (one atomic per item: items
   are chunks of products and spans of attention, microseconds each) */
static inline void run_shares(int index, int team) {
    for (int k = 0; k < team; k++) {
        share_t *share = pool.shares + (index + k) % team;
        for (int64_t item; (item = atomic_fetch_add_explicit(&share->next, 1, memory_order_relaxed)) < share->stop;)
            pool.fn(pool.context, item, item + 1);
    }
}

static void *worker(void *argument) {
    const int index = (int)(intptr_t)argument;
    unsigned seen = pool.start_ticket; /* not the ticket now: the first part may already have been posted */
    for (;;) {
        while (atomic_load_explicit(&pool.ticket, memory_order_acquire) == seen) {
            if (atomic_load_explicit(&pool.active, memory_order_relaxed)) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&pool.lock);
            while (!atomic_load(&pool.active) && atomic_load(&pool.ticket) == seen)
                pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        const int team = (int)(seen & 0xFF); /* the part's own team, however late this worker looks */
        if (index < team) {
            run_shares(index, team);
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        }
    }
    return 0;
}

/* In a forked child: none of the workers exist there, and the mutexes and the condition variable hold
   the parent's state at the fork (a mutex another thread held stays held; glibc's condition variable
   counts waiters that are not there, and a broadcast waits for them forever). So the child starts with
   a new pool: fresh synchronisation, no workers, nothing active; the next step creates its own. */
static void pool_after_fork_in_child(void) {
    pthread_mutex_init(&pool.held, 0);
    pthread_mutex_init(&pool.lock, 0);
    pthread_cond_init(&pool.wake, 0);
    atomic_store(&pool.active, 0);
    atomic_store(&pool.done, 0);
    pool.workers = 0;
    pool.owner = getpid();
}

__attribute__((constructor)) static void pool_register_fork_handler(void) {
    pthread_atfork(0, 0, pool_after_fork_in_child);
}

/* Take the pool for a step on `threads` threads: the team it got (1: run alone, nothing to release). */
int pool_begin(int threads) {
    if (threads <= 1 || pthread_mutex_trylock(&pool.held) != 0) return 1;
    if (pool.owner != getpid()) { /* first use (a forked child starts afresh: pool_after_fork_in_child) */
        pool.workers = 0;
        pool.owner = getpid();
    }
    if (threads - 1 > MAX_WORKERS) threads = MAX_WORKERS + 1;
    pool.start_ticket = atomic_load(&pool.ticket); /* unchanged until pool_run: this thread posts the parts */
    while (pool.workers < threads - 1) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attributes, worker, (void *)(intptr_t)(pool.workers + 1));
        pthread_attr_destroy(&attributes);
        if (failed) break;
        pool.workers++;
    }
    if (pool.workers == 0) {
        pthread_mutex_unlock(&pool.held);
        return 1;
    }
    pthread_mutex_lock(&pool.lock);
    atomic_store(&pool.active, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    return pool.workers + 1 < threads ? pool.workers + 1 : threads;
}

/* Let the workers sleep and the pool go (team > 1 only). */
void pool_end(void) {
    atomic_store(&pool.active, 0);
    pthread_mutex_unlock(&pool.held);
}

/* fn(context, item, item + 1) for every item of [0, items), shared among the caller and `team` - 1 workers. */
void pool_run(int team, int64_t items, part_fn fn, void *context) {
    if (team <= 1 || items <= 1) {
        if (items > 0) fn(context, 0, items);
        return;
    }
    pool.fn = fn;
    pool.context = context;
    for (int i = 0; i < team; i++) {
        atomic_store_explicit(&pool.shares[i].next, items * i / team, memory_order_relaxed);
        pool.shares[i].stop = items * (i + 1) / team;
    }
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    const unsigned part = (atomic_load_explicit(&pool.ticket, memory_order_relaxed) >> 8) + 1;
    atomic_store_explicit(&pool.ticket, (part << 8) | (unsigned)team, memory_order_release);
    run_shares(0, team);
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < team - 1) _mm_pause();
}
