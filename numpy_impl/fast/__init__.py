"""What changes a loaded model from outside: model.py and nn.py stay the lesson (torch.nn's stand-in),
and port.load_model applies these to the model it has loaded.

- layout.py: each matrix's bytes in the memory order OpenBLAS streams fastest at batch 1
- cores.py: each large product's output rows split across the threads the process is given
  (off by default), and a float32 prompt's attention by causal query blocks across them
  (installed by kvports.threads.use_threads at any count --threads gives, the count being the process's)
- row_loop.py: a float32 decode step's products as a loop numba compiles, the weight's rows dealt
  across those threads (installed with the prompt attention, where numba is installed)
"""
