"""``sparseattn bench``: the user-path suite (``userpath``), the engine suites on ready graphs
(``kernels``), ``engine="auto"`` against every engine over a grid (``autogrid``), and the
developer tools behind the engine constants (``calibrate``, ``profile``).
Needs the ``cli`` extra (figures): ``pip install 'sparseattn[cli]'``."""

from ..._extras import require

require("matplotlib", "cli", "sparseattn.lab.bench")
