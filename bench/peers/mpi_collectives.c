/* Peer of the collective benchmarks: the measurements of torch_dist_collectives.py, in C with
 * Open MPI (Debian's openmpi 4.1).
 *
 * For each op (MPI_Allreduce MPI_SUM on float in place, MPI_Bcast from rank 0, MPI_Allgather into
 * a separate buffer, MPI_Reduce_scatter_block MPI_SUM and MPI_Alltoall from an input buffer of n
 * blocks into a separate buffer) and each size (bytes of a rank's input: count = max(1, bytes / 4)
 * floats, for reduce_scatter and all_to_all count = max(1, bytes / 4 / n) per block): an
 * MPI_Barrier, warm-up calls, then timed calls, each one timed alone with MPI_Wtime() around the
 * call only. Big sizes get fewer calls: timed = max(3, min(iters, iters * 1 MiB / max(bytes, 1 MiB))),
 * warm-up = max(1, min(warmup, timed)). One untimed call afterwards checks the result.
 * Rank 0 prints one JSON object per line, the same keys as the torch peer:
 *   {"system": "openmpi", "op", "bytes", "ranks", "iters", "median_us", "p99_us", "min_us",
 *    "busbw_GBps"}
 * over rank 0's per-call times: median_us is their median, p99_us the nearest-rank 99th
 * percentile (sorted[ceil(0.99 n) - 1]; with fewer than 100 timed calls that is the maximum),
 * min_us the fastest call; busbw follows nccl-tests (see torch_dist_collectives.py; reduce_scatter
 * and all_to_all: (n-1)/n x input bytes / t, as bench/dist/coll_bench.cpp). "bytes" is the size
 * asked for (the rows of every system line up on it).
 *
 * usage: mpi_collectives [--ops all_reduce,broadcast,all_gather,reduce_scatter,all_to_all]
 *            [--sizes 4,4096,1048576,16777216,67108864] [--iters 50] [--warmup 5]
 * build: mpicc -O2 -o mpi_collectives bench/peers/mpi_collectives.c
 * run (as root, 2 cores; no extra MCA settings were needed, shared memory goes through vader):
 *   mpirun --allow-run-as-root --oversubscribe -np 2 ./mpi_collectives --sizes 4,4096 --iters 20
 * Without --oversubscribe Open MPI refuses -np larger than the number of cores it counts.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, NOPS };
static const char *OP_NAMES[NOPS] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                     "all_to_all"};

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* v must be sorted (ascending). */
static double median(const double *v, int n) {
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Nearest-rank 99th percentile of sorted v: v[ceil(0.99 n) - 1], the maximum when n < 100. */
static double p99(const double *v, int n) {
    return v[(n * 99 + 99) / 100 - 1];
}

static void die(const char *msg) {
    fprintf(stderr, "mpi_collectives: %s\n", msg);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* One collective on buf; count floats per rank (per block for reduce_scatter and all_to_all, whose
 * buf holds nranks blocks). all_gather and all_to_all write count * nranks floats to out,
 * reduce_scatter count floats. */
static void run_op(int op, float *buf, float *out, int count) {
    if (op == ALL_REDUCE)
        MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (op == BROADCAST)
        MPI_Bcast(buf, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
    else if (op == REDUCE_SCATTER)
        MPI_Reduce_scatter_block(buf, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (op == ALL_TO_ALL)
        MPI_Alltoall(buf, count, MPI_FLOAT, out, count, MPI_FLOAT, MPI_COMM_WORLD);
    else
        MPI_Allgather(buf, count, MPI_FLOAT, out, count, MPI_FLOAT, MPI_COMM_WORLD);
}

/* One untimed call with known inputs; aborts if the result is wrong. */
static void check(int op, float *buf, float *out, int count, int rank, int n) {
    int lists = op == REDUCE_SCATTER || op == ALL_TO_ALL;
    long in_total = lists ? (long)count * n : count;
    for (long i = 0; i < in_total; i++) buf[i] = rank + 1;
    run_op(op, buf, out, count);
    long total = op == ALL_GATHER || op == ALL_TO_ALL ? (long)count * n : count;
    for (long i = 0; i < total; i++) {
        float want = op == ALL_REDUCE || op == REDUCE_SCATTER ? n * (n + 1) / 2.0f
                   : op == BROADCAST ? 1.0f : (float)(i / count + 1);
        if ((op == ALL_REDUCE || op == BROADCAST ? buf[i] : out[i]) != want) die("wrong result");
    }
}

int main(int argc, char **argv) {
    char ops_arg[256] = "all_reduce,broadcast,all_gather,reduce_scatter,all_to_all";
    char sizes_arg[1024] = "4,4096,1048576,16777216,67108864";
    int iters = 50, warmup = 5, rank, n;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) die("every flag takes a value (--ops, --sizes, --iters, --warmup)");
        if (!strcmp(argv[i], "--ops")) snprintf(ops_arg, sizeof ops_arg, "%s", argv[++i]);
        else if (!strcmp(argv[i], "--sizes")) snprintf(sizes_arg, sizeof sizes_arg, "%s", argv[++i]);
        else if (!strcmp(argv[i], "--iters")) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup")) warmup = atoi(argv[++i]);
        else die("unknown flag; usage: --ops a,b --sizes n,m --iters N --warmup W");
    }
    if (iters < 1 || warmup < 0) die("--iters must be >= 1 and --warmup >= 0");

    int ops[16], nops = 0;
    for (char *tok = strtok(ops_arg, ","); tok; tok = strtok(NULL, ",")) {
        int op = 0;
        while (op < NOPS && strcmp(tok, OP_NAMES[op])) op++;
        if (op == NOPS || nops == 16)
            die("ops must be among all_reduce,broadcast,all_gather,reduce_scatter,all_to_all");
        ops[nops++] = op;
    }
    long sizes[64];
    int nsizes = 0;
    for (char *tok = strtok(sizes_arg, ","); tok; tok = strtok(NULL, ",")) {
        if (nsizes == 64) die("at most 64 sizes");
        sizes[nsizes++] = atol(tok);
    }

    double *times = malloc(sizeof(double) * (iters > 3 ? iters : 3));
    if (!times) die("out of memory");
    /* Written before timing, as torchpar's harness does (bench/support/call_times.h): a heap
     * page first touched between two timed calls costs 3-5 us on these VMs, which the other
     * rank waits out inside its call. */
    memset(times, 0, sizeof(double) * (iters > 3 ? iters : 3));
    for (int o = 0; o < nops; o++) {
        int op = ops[o];
        for (int s = 0; s < nsizes; s++) {
            int lists = op == REDUCE_SCATTER || op == ALL_TO_ALL, blocks = lists ? n : 1;
            int count = sizes[s] / 4 / blocks > 0 ? (int)(sizes[s] / 4 / blocks) : 1;
            long nbytes = sizes[s] > 4 ? sizes[s] : 4, mib = 1L << 20;
            long scaled = (long)iters * mib / (nbytes > mib ? nbytes : mib);
            int timed = scaled < iters ? (int)scaled : iters;
            if (timed < 3) timed = 3;
            int warm = warmup < timed ? warmup : timed;
            if (warm < 1) warm = 1;
            float *buf = calloc((size_t)count * blocks, sizeof(float));
            size_t out_count = op == ALL_GATHER || op == ALL_TO_ALL ? (size_t)count * n
                             : op == REDUCE_SCATTER ? (size_t)count : 0;
            float *out = out_count ? calloc(out_count, sizeof(float)) : NULL;
            if (!buf || (out_count && !out)) die("out of memory");
            /* Written before timing, as torchpar's inputs (at::ones): a large calloc is fresh
             * mmap'd pages that all read as the kernel's one zero page until written, so an op
             * that only reads its input (all_gather, reduce_scatter, all_to_all) would copy
             * from one cached 4 KiB page (64 MiB all_to_all: 6.0 ms instead of 11.7). */
            for (size_t i = 0; i < (size_t)count * blocks; i++) buf[i] = 1.0f;
            MPI_Barrier(MPI_COMM_WORLD);
            for (int i = 0; i < warm; i++) run_op(op, buf, out, count);
            for (int i = 0; i < timed; i++) {
                double t0 = MPI_Wtime();
                run_op(op, buf, out, count);
                times[i] = MPI_Wtime() - t0;
            }
            check(op, buf, out, count, rank, n);
            if (rank == 0) {
                qsort(times, timed, sizeof *times, cmp_double);
                double med = median(times, timed);
                double data = op == ALL_GATHER ? (double)count * 4 * n
                            : (double)count * 4 * blocks;
                double factor = op == ALL_REDUCE ? 2.0 * (n - 1) / n
                              : op == BROADCAST ? 1.0 : (double)(n - 1) / n;
                printf("{\"system\": \"openmpi\", \"op\": \"%s\", \"bytes\": %ld, \"ranks\": %d, "
                       "\"iters\": %d, \"median_us\": %.3f, \"p99_us\": %.3f, \"min_us\": %.3f, "
                       "\"busbw_GBps\": %.6g}\n",
                       OP_NAMES[op], nbytes, n, timed, med * 1e6, p99(times, timed) * 1e6,
                       times[0] * 1e6, data / med * factor / 1e9);
                fflush(stdout);
            }
            free(buf);
            free(out);
        }
    }
    free(times);
    MPI_Finalize();
    return 0;
}
