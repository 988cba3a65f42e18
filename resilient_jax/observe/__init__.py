"""What a run shows about itself: log lines (`logs`), progress of long waits (`progress`),
profiled steps and their replay (`profiling`, `timeline`), goodput (`goodput`) and TensorBoard
events (`tensorboard`). The loop feeds them; none of them drives training."""
