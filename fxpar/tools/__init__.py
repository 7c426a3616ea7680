"""Tools that drive fxpar from outside its compile-and-run road: the calibration harness, which measures this
machine with spawned gloo ranks (:mod:`.calibrate`, :mod:`.probes`) and fxpar's runtime's own cost per graph
(:mod:`.runtime_cost`), for ``ClusterSpec.calibrate()``. Import the module you need; this package loads nothing."""
__all__: list = []
