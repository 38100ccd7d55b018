"""Many ranks as one: the executors (in-process, multiprocessing, Ray), a rank and its process, the process grid and its groups, and the child processes our ranks and cores run in."""
