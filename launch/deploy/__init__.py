"""`shardserve deploy`: the files that run a plan on Kubernetes (Deployment, LeaderWorkerSet, KubeRay) or Slurm, derived from the plan and written at once."""
