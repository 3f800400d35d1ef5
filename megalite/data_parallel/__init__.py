"""Data-parallel gradients: the flat buffers every parameter's gradient lands in, their bucketed
reduction over dp ranks overlapped with backward (ZeRO-2: only the owned piece), and the
fix-ups a step's gradients need before the optimizer reads them. Below the pipeline executor
and the optimizer, which both use them."""
