"""Benchmark building blocks shared by tools/bench_train.py, bench_kernels.py and bench_gpu.py.

    workload   the S2 shape, synthetic tokens, the framework and baseline runners
    harness    rows, this process and persistent pools of gloo ranks, interleaved measurement rounds
    meters     the saved-tensor activation meter and the engine trace statistics
    report     tables, device and command lines, the docs/benchmarks.md sections
    throughput, tensor_parallel, pipeline, precision: the four sections of bench_train
"""
