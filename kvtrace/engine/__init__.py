"""``kvtrace engine``: a live CPU engine core to capture from, running vLLM's own scheduler and
prefix cache over a workload (``core``), and the driver that starts one as a child process
(``process``)."""
