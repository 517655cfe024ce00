"""Weight transfer, trainer → inference, as one component: the modes (`filesystem`, `broadcast`, `shared`), what each
supports, and per mode a publisher (trainer side) and a receiver (inference side) behind one interface.

- `modes`: the `WeightTransfer` type and each mode's capabilities and refusals. Torch-free: the config layer and the
  launchers ask it what a mode supports instead of comparing names.
- `base`: the interfaces. A `Publisher` publishes every policy version as `weights/step_<k>/`
  (primerl.transport.snapshots), falling back to the filesystem when its mode fails; a `Receiver` makes a published
  version live in the server's engine. The trainer and the server plug in through `WeightSource` and
  `ServingEngine`, so this package imports neither.
- `filesystem`, `weight_group` (mode `broadcast`), `shared_buffer` (mode `shared`): one publisher and one receiver each.
- `factory`: `build_publisher` and `build_receivers`, the only place that maps a mode to its classes.
"""
