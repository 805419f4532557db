"""The training loop, the orchestration: building a run (``build``), the loop and its events
(``trainer``, ``parts``, ``monitors``, ``nonfinite``), ``train.fit`` (``fitting``) and its
compiled twin (``compiled``), the dev runs (``devrun``), ``--eject`` and ``--show-*``. The
step machinery it runs lives in ``train/step/``; the sections it composes in their rooms."""
