"""What people write about a memory failure: issue titles, one-line summaries, descriptions.

Real input to the doctor is often not a log but a sentence ("Gives OOM, works with
enforce-eager", "[Bug]: ValueError: No available memory for the cache blocks", "the node runs
low on memory"). This module holds the regular expressions that read such text as weaker
evidence: a statement that memory ran out, the settings and mechanisms it names, the fix the
writer says worked, the GPU and vLLM versions it mentions.

vLLM's own log lines (a logger header with level DEBUG/INFO/WARNING) are never statements of
a failure: their warnings say "to avoid OOM", "may cause out-of-memory errors", "If you are
running out of memory, consider …". Such lines, and any statement hedged by "if", "may",
"avoid", "risk" … shortly before the words, are ignored by :func:`is_statement`.
"""

from __future__ import annotations

import re

# logger levels whose lines are vLLM's own messages, not a report of what happened
QUIET_LEVELS = frozenset({"DEBUG", "INFO", "WARNING", "WARN"})

_MEM_WORD = r"(?:memory|vram|ram)"
_WHERE = r"(?:(?:gpu|cuda|device|cpu|host|system|node)[ -])?"

# a KV cache said to be too small: "insufficient KV cache memory", "not enough KV cache",
# "the KV cache is too small", "KV cache 不足"
KV_SHORT = (
    r"(?i:\binsufficient\s+(?:gpu\s+)?KV[ -]?cache\b"
    r"|(?:\bnot|n't|\bnever)\s+(?:\w+\s+){0,2}?enough\s+(?:free\s+)?(?:gpu\s+)?"
    r"(?:memory\s+for\s+(?:the\s+)?(?:\w+\s+)?)?KV[ -]?cache\b"
    r"|\bKV[ -]?cache(?:\s+memory|\s+space)?\s+(?:is\s+|was\s+)?"
    r"(?:too\s+small|insufficient|not\s+(?:big|large)\s+enough)\b"
    r"|KV\s?cache\s?(?:空间|容量)?(?:不足|不够|太小))"
)

# a statement that memory ran out
SAID_OOM = (
    # (no \b: next to CJK text, "报OOM错误", there is no word boundary)
    r"(?i:(?<![A-Za-z0-9_])OOM(?:s|ed|ing|'ed|-?kill\w*)?(?![A-Za-z0-9_])"
    # the same in Chinese reports: GPU memory (显存) or memory (内存) insufficient, overflowing,
    # full, "blown"
    r"|(?:显存|内存)[^\s，。,.!?！？]{0,6}?"
    r"(?:不足|不够|溢出|爆了|占满|耗尽|用完|过小|太小)|爆显存|(?:超过|超出)显存"
    # a KV cache too small for what was asked is the same failure, told by its consequence
    r"|"
    + KV_SHORT
    # (with the usual typos: "out of menory")
    + rf"|\bout[ -]of[ -]{_WHERE}(?:memory|menory|memroy|memery)\b"
    rf"|\b(?:run|runs|ran|running|going|go|goes|went)\s+out\s+of\s+{_WHERE}{_MEM_WORD}\b"
    r"|(?:\bnot|n't|\bnever)\s+(?:have\s+|has\s+|had\s+)?enough\s+"
    rf"(?:free\s+)?{_WHERE}{_MEM_WORD}\b"
    rf"|\binsufficient\s+{_WHERE}{_MEM_WORD}\b"
    # "my memory is insufficient", "the VRAM was not enough"
    rf"|\b{_MEM_WORD}\s+(?:is|was|are|were)\s+(?:insufficient|not\s+enough)\b"
    r"|\blow\s+on\s+memory\b|\bmemory\s+pressure\b"
    # "cannot load Llama 3.2 3B on a 16GB GPU": a model that does not fit a stated memory size
    r"|\b(?:can't|cannot|can\s+not|unable\s+to|fail(?:s|ed)?\s+to)\s+(?:load|run|fit|start|serve)\b"
    r"(?:[^.\n]|\.(?=\d)){0,60}?\bon\s+(?:a\s+|an\s+|my\s+|one\s+|two\s+|\d\s?[x×*]?\s?)?"
    r"\d+\s?(?:G|GB|GiB)\b"
    # a failure told as what memory did: "exceeds the memory limit", "balloons memory and then
    # crashes the DGX", "memory keeps growing until …", "sees each other's allocations"
    # (one branch behind a one-character look-ahead: cheap at positions that start none of them)
    r"|\b(?=[ebcmvr])(?:"
    rf"exceed(?:s|ed|ing)?\s+(?:the\s+|its\s+|my\s+)?{_WHERE}{_MEM_WORD}\s+"
    r"(?:limit|capacity|budget)\b"
    rf"|balloon(?:s|ed|ing)?\s+(?:the\s+)?{_WHERE}{_MEM_WORD}\b|{_MEM_WORD}\s+balloon(?:s|ed|ing)\b"
    rf"|{_MEM_WORD}\s+(?:usage\s+)?(?:keeps|kept)\s+"
    r"(?:growing|increasing|rising|climbing)\s+until\b"
    r"|crash(?:es|ed|ing)?\s+the\s+(?:whole\s+|entire\s+)?"
    r"(?:machine|box|DGX|server|host|node|system|computer)\b"
    r"|each\s+other'?s\s+(?:memory\s+)?allocations?\b))"
)

# the Chinese phrasings above, as the catalogue's cheap triggers
CJK_OOM_TRIGGERS = ("显存", "内存")

# words that make a statement conditional or advice ("to avoid OOM", "if you run out of …")
_HEDGE = re.compile(
    r"(?i)\b(?:if|avoid\w*|prevent\w*|may|might|could|would|risk\w*|potential\w*|consider\w*"
    r"|unless|whether|possibl[ey]|likely|reduce the chance|in case|to reduce)\b"
)
_CONDITION = re.compile(r"(?i)^(?:if|unless|in case|whether)$")
# a failure the same sentence reports: "crashes … if the system doesn't have enough RAM" states
# what happened; "if you are running out of memory, consider …" does not
_FAILURE_VERB = re.compile(r"(?i)\b(?:crash\w*|fail\w*|killed|abort\w*|died|dies|error)\b")
_SENTENCE_END = re.compile(r"[.;!?](?:\s|$)")


def is_statement(text: str, start: int, level: str) -> bool:
    """Whether the words at ``text[start:]`` state that something happened: not a vLLM log
    line of a quiet level, and not hedged within the same sentence just before them (a
    condition such as "if" counts as a hedge only when the sentence reports no failure)."""
    if level in QUIET_LEVELS:
        return False
    window = text[max(0, start - 48) : start]
    ends = list(_SENTENCE_END.finditer(window))
    if ends:
        window = window[ends[-1].end() :]
    hedges = [h.group(0) for h in _HEDGE.finditer(window)]
    if not hedges:
        return True
    if all(_CONDITION.match(h) for h in hedges):
        sentence = text[max(0, start - 200) : start]
        ends = list(_SENTENCE_END.finditer(sentence))
        if ends:
            sentence = sentence[ends[-1].end() :]
        return _FAILURE_VERB.search(sentence) is not None
    return False


# --- mechanisms a text names (signature name → regex) --------------------------------------
_LEVERS = (
    r"enforce[-_ ]eager|max[-_ ]num[-_ ]seqs?|batch[-_ ]size|max[-_ ]num[-_ ]batched[-_ ]tokens"
    r"|max[-_ ]model[-_ ]len|max[-_ ]seq[-_ ]len|context\s+length"
    r"|(?:gpu[-_ ])?memory[-_ ]utili[sz]ation"
    # the context length in Chinese: 上下文长度 (context length), token长度, 序列长度 (sequence)
    r"|上下文长度|token\s?长度|序列长度"
    r"|tensor[-_ ]parallel[-_ ]size|tensor[-_ ]parallel\w*|swap[-_ ]space|expandable_segments"
    r"|limit[-_ ]mm[-_ ]per[-_ ]prompt|VLLM_USE_V1=0|cpu[-_ ]offload\w*|kv[-_ ]cache[-_ ]dtype"
)
# "works with enforce-eager", "I have to reduce max_num_seqs to 4", "setting
# --max-model-len 8192 fixed it": the fix the writer says worked
WORKAROUND = re.compile(
    r"(?i)(?:\b(?:works?|worked|working|runs?|ran|fine|ok(?:ay)?|solved|fixe[sd]|resolved|helps?"
    r"|helped|succeed\w*)\b"
    r"[^.\n]{0,30}?\b(?:with|by|after|when|using|once)\b[^.\n]{0,20}?(?P<a>" + _LEVERS + r")"
    r"|\b(?:had|have|has|need(?:ed)?|must)\s+to\s+"
    r"(?:reduce|lower|decrease|set|add|use|pass|disable|enable|turn\s+off|limit|cap)\b"
    r"[^.\n]{0,20}?(?P<b>" + _LEVERS + r")"
    r"|(?P<c>" + _LEVERS + r")[^.\n]{0,40}?\b(?:fixe[sd]|solve[sd]|resolve[sd]|helps|helped)\b"
    # the failure happens "unless X" / "as long as I do not enable X": X avoids it
    r"|\b(?:unless|as\s+long\s+as\s+(?:I|we|you)\s+(?:do\s+not|don't|dont)"
    r"|except\s+(?:with|when))\b[^.\n]{0,25}?(?P<d>" + _LEVERS + r")"
    # in Chinese: "解决方案就是设置降低模型的token长度" (the solution: lower the token length),
    # "通过设置 --max-model-len 16384解决" (solved by setting …)
    r"|(?:解决|解決)[^。\n]{0,12}?(?:降低|减小|调小|减少|设置|改小|限制)[^。\n]{0,12}?(?P<e>"
    + _LEVERS
    + r")"
    r"|通过[^。\n]{0,12}?(?P<f>" + _LEVERS + r")[^。\n]{0,20}?(?:解决|解決))"
)

# "so decrease it from 0.7 to 0.6", "max_num_seqs 256 -> 64", "lowered --max-model-len from
# 32768 to 8192": a setting changed from one value to another. Written after a (possibly hedged)
# statement that the old value runs out of memory, it reports the failure and the fix that
# worked; "it" refers to the last lever named before it in the same text.
_NUM = r"\d+(?:\.\d+)?"
_CHANGE_VERB = r"(?:decreas|reduc|lower|increas|rais|chang|bump|drop|cut)\w*"
LEVER_CHANGE = re.compile(
    r"(?i)(?:\b"
    + _CHANGE_VERB
    + r"\s+(?:(?P<it>it|this|that|the\s+value)|(?:the\s+)?-*(?P<a>"
    + _LEVERS
    + r")(?:\s+(?:setting|value|parameter))?)\s+from\s+(?P<x>"
    + _NUM
    + r")\s+to\s+(?P<y>"
    + _NUM
    + r")(?![\d.]\d)"
    r"|-*(?P<b>"
    + _LEVERS
    + r")\s*[:=]?\s*(?:from\s+)?(?P<x2>"
    + _NUM
    + r")\s*(?:->|→|=>)\s*(?P<y2>"
    + _NUM
    + r")(?![\d.]\d))"
)
_LEVER_NAME = re.compile(r"(?i)" + _LEVERS)
# "even after I reduced it …", "… still OOM", "did not help": a change that did not avoid it
_IN_VAIN_BEFORE = re.compile(r"(?i)\beven\s+(?:after|when|if|with|though)\b[^.;!?\n]{0,30}$")
_IN_VAIN_AFTER = re.compile(
    r"(?i)^[^.;!?\n]{0,40}?\b"
    r"(?:still|same\s+(?:error|issue|problem|oom)|(?:did|does|do|was|is)(?:n't|\s+not)"
    r"|not\s+(?:help\w*|work\w*|fix\w*|solv\w*)|no\s+(?:luck|help|difference|effect)"
    r"|nothing|in\s+vain)\b"
)


def lever_change(text: str, match: re.Match[str]) -> tuple[str, float, float] | None:
    """The lever, old and new value of a :data:`LEVER_CHANGE` match; for "decrease it from …"
    the lever is the last one named before the match in ``text``. None when there is no lever
    or the text says the change did not help ("even after …", "… still OOM")."""
    if _IN_VAIN_BEFORE.search(text, 0, match.start()) or _IN_VAIN_AFTER.search(
        text[match.end() : match.end() + 80]
    ):
        return None
    lever = match.group("a") or match.group("b")
    if lever is None:
        before = list(_LEVER_NAME.finditer(text, 0, match.start()))
        if not before:
            return None
        lever = before[-1].group(0)
    old, new = match.group("x") or match.group("x2"), match.group("y") or match.group("y2")
    try:
        return lever, float(old), float(new)
    except (TypeError, ValueError):
        return None


# a lever tried without avoiding the failure: "even with --enforce-eager", "I drop memory
# utilization to 0.92, I reload. OOM.", "tried reducing max_num_seqs but still OOM"
_STILL_FAILED = (
    r"(?:still\s+(?:get\s+|got\s+|have\s+|had\s+|hit\s+)?(?:an?\s+|the\s+)?"
    r"(?:OOM|out\s+of\s+memory|same|fail\w*|crash\w*)|OOM\b"
    r"|same\s+(?:error|issue|problem|OOM|result)"
    r"|(?:did|does|do)(?:n't|\s+not)\s+(?:help|work|fix|change|solve)"
    r"|no\s+(?:luck|help|difference|effect|change)|to\s+no\s+avail"
    r"|nothing\s+(?:changed|helped|works?))"
)
TRIED_IN_VAIN = re.compile(
    r"(?i)(?:\beven\s+(?:with|after|when|though|if)\b[^.;!?\n]{0,30}?(?P<a>" + _LEVERS + r")"
    r"|(?P<b>" + _LEVERS + r")(?:[^.;!?\n]|\.(?=\d)){0,60}?(?:[.;,!]\s*|\s+(?:and|but)\s+)"
    r"(?:(?:it|I|we|vllm|the\s+server)\s+)?"
    + _STILL_FAILED
    + r"|\b(?:tried|trying|tested|testing)\b(?:[^.;!?\n]|\.(?=\d)){0,40}?(?P<c>"
    + _LEVERS
    + r")(?:[^.;!?\n]|\.(?=\d)){0,60}?\b"
    + _STILL_FAILED
    + r")"
)
# "I tried multiple combinations of the above parameters, all of which result in this": every
# setting the text names was tried
TRIED_ALL = re.compile(
    r"(?i)\btried\s+(?:(?:many|multiple|multile|several|various|different|all(?:\s+the)?"
    r"|a\s+lot\s+of)\s+)?"
    r"(?:combinations|settings|parameters|options|values|configurations|configs|variations)\b"
    r"[^.\n]{0,80}?\b(?:all|each|every|none|still|same)\b"
)

# lever text → the cause it addresses
LEVER_CAUSE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(?i)enforce|VLLM_USE_V1"), "cuda_graph"),
    (re.compile(r"(?i)num[-_ ]seqs|batch"), "concurrency_or_batch"),
    (
        re.compile(r"(?i)model[-_ ]len|seq[-_ ]len|context|kv[-_ ]cache[-_ ]dtype|长度"),
        "kv_too_small_for_max_len",
    ),
    (re.compile(r"(?i)utili"), "util_overshoot"),
    (re.compile(r"(?i)tensor|offload"), "weights_dont_fit"),
    (re.compile(r"(?i)swap"), "cpu_ram"),
    (re.compile(r"(?i)expandable"), "fragmentation"),
    (re.compile(r"(?i)limit[-_ ]mm"), "multimodal_encoder"),
)

# memory said not to be given back: "not properly released", "never freed"
NOT_FREED = r"\b(?:not|never)\s+(?:(?:properly|fully|correctly|being)\s+)?(?:freed|released)\b"

MENTIONS: dict[str, str] = {
    "said_capture": (
        r"(?i:\bcuda[ -]?graphs?\b|\bcudagraphs?\b|\bgraph[ -]captur\w*"
        r"|\bcaptur\w*\s+(?:the\s+model\s+for\s+)?cuda\b|\bcapture_model\b"
        r"|\bcapture[-_ ]sizes?\b)"
    ),
    "said_sampler": (
        r"(?i:\bsampler[ _-]?warm[ _-]?up\b"
        r"|\bwarming\s+up\s+(?:the\s+)?sampler\b|_dummy_sampler_run"
        # a warm-up that allocates logits over the vocabulary is the sampler's
        r"|\bwarm[ _-]?up\b[^.\n]{0,100}?\b(?:logits|vocab\w*)\b"
        r"|\b(?:logits|vocab\w*)\b[^.\n]{0,100}?\bwarm[ _-]?up\b)"
    ),
    # a failure traced to one vLLM change: "narrowed this down to PR #19572", "bisected to
    # commit abc123", "introduced by #18724", "a regression since 0.9.1"
    "said_code_regression": (
        r"(?i:\bnarrowed\s+(?:it\s+|this\s+)?down\s+to\b|\bbisect\w*\b"
        r"|\bintroduced\s+(?:by|in|the\s+(?:issue|bug|problem|regression|oom))\b"
        r"|\b(?:caused|broken)\s+by\s+(?:the\s+)?(?:PR|commit|pull|#\d+|https?://\S+/pull/)"
        r"|\bregression\s+(?:from|in|since|introduced|caused)\b"
        # a code change resolved it: "it works with the fixes", "the fix mentioned in his PR",
        # "after applying the patch from #41834"
        r"|\b(?:works?|worked|working|fixed|resolved|solved)\s+(?:now\s+)?(?:with|after)\s+"
        r"(?:applying\s+)?(?:the|this|that|his|her|their|your)\s+"
        r"(?:fix|fixes|patch|patches|PR|branch)\b"
        r"|\bthe\s+fix\s+(?:mentioned\s+|described\s+)?in\s+"
        r"(?:the\s+|his\s+|her\s+|their\s+|this\s+|that\s+)?(?:PR|pull\s+request|branch|commit)\b"
        r"|\bapply(?:ing)?\s+(?:the\s+)?(?:patch|fix)\s+(?:from|in|of)\s+(?:PR\s*)?#?\d+)"
    ),
    "said_multimodal": (
        r"(?i:\bimages\b|\bvideos?\b|\bvision\b|\bvisual\b|\bmulti-?modal\b"
        r"|\bVLMs?\b|\bpixels?\b|max_pixels|mm_processor|limit[-_]mm|encoder cache"
        r"|ForConditionalGeneration|max-resolution image"
        r"|\bimage\s+(?:input|encoder|tokens|size|resolution|features))"
    ),
    "said_fragmentation": r"(?i:\bfragment\w*)",
    "said_kv_short": KV_SHORT,
    # host memory named, or a process table of host memory (ps/top columns RSS, %MEM, MEM(GB))
    "said_host_ram": (
        r"(?i:(?<!显)(?<!gpu)(?<!cuda)(?<!卡)(?<!gpu )(?<!cuda )内存"
        r"|\bcrash(?:es|ed|ing)?\s+the\s+(?:whole\s+|entire\s+)?"
        r"(?:machine|box|DGX|host|node|computer)\b|\b(?:host|cpu|system|node)[\s-]+(?:ram|memory)\b"
        r"|\bhost-OOM\w*"
        r"|(?<!gpu )(?<!v)\bRAM\b|\bswap\b|swap[-_ ]space|\bpinned\b|pin_memory"
        r"|\bmmap\b|\bcgroup\b|\bRSS\b|%MEM\b|\bfree\s+-[hgm]\b|\bMEM\s?\((?:GB|GiB|MB|MiB)\)"
        r"|\bray\s+OOM\b"
        r"|\bcontainer(?:'s)?\s+(?:memory|RAM)\b"
        r"|\bmemory\s+(?:limit|cap)\s+(?:of\s+)?(?:the\s+)?container\b"
        r"|\bdocker\b[^\n]{0,80}?\s--memory\b)"
    ),
    # the GPU is said not to be full when memory ran out: the memory that ran out was the host's
    "said_gpu_not_full": (
        r"(?i:\b(?:nvidia-smi|the\s+gpu|vram)\b[^.\n]{0,30}?\b"
        r"(?:doesn't|does\s+not|didn't|did\s+not|isn't|is\s+not|wasn't|was\s+not)"
        r"\s+(?:show\s+)?(?:(?:it's|it\s+is|that\s+it's)\s+)?"
        r"(?:using\s+|used\s+|at\s+)?(?:all|full)\b)"
    ),
    # sleep mode's wake-up and the caching allocator's cached blocks (torch.cuda.empty_cache)
    "said_wake_up": r"(?i:\bwake[_ -]?up\b)",
    "said_empty_cache": r"(?i:\bempty_cache\b|\bcaching\s+allocator\b)",
    "said_colocated": (
        r"(?i:\b(?:GRPO|PPO|DPO|RLHF|OpenRLHF|verl|SkyRL|NeMo[- ]RL|trainer|training"
        r"|colocat\w*|co-locat\w*|rollouts?)\b|\bshared\s+GPUs?\b"
        r"|\bGPUs?\s+(?:is\s+|are\s+)?shared\b)"
    ),
    "said_other_process": (
        r"(?i:\banother\s+(?:process|engine|instance|model|job)\b"
        r"|\bother\s+(?:process(?:es)?|engines?|jobs?)\b"
        r"|\bprevious\s+(?:engine|instance|process|model|llm)\b|\bleft-?over\b"
        r"|\bzombie\b|\borphan\w*|\bdel\s+llm\b|"
        + NOT_FREED
        # in Chinese: not released (没有释放, 并没有得到释放), still occupied (一直占用, 还在被占用)
        + r"|(?:没有|并没有|未|没)(?:得到|被)?释放|一直占用|还在被?占用|仍(?:然)?被?占用"
        + r"|\bstill\s+in\s+use\b|\bsecond\s+(?:LLM|engine|instance|model)\b"
        r"|\beach\s+other'?s\s+(?:memory\s+)?allocations?\b"
        r"|\b(?:replicas|engines|instances)\b[^.\n]{0,60}?\bshar\w*\s+(?:one|a|the\s+same)\s+GPU\b)"
    ),
    "said_max_len": (
        r"(?i:上下文(?:长度|窗口)|token\s?长度|序列长度|max[-_ ]model[-_ ]len"
        r"|max[-_ ]seq[-_ ]len|\bcontext\s+(?:length|window|size)\b"
        r"|\blong\s+(?:context|prompts?|inputs?|sequences?)\b|\b\d+k\s+context\b|rope[-_ ]scaling)"
    ),
    "said_batch": (
        r"(?i:max[-_ ]num[-_ ]seqs?|max[-_ ]num[-_ ]batched[-_ ]tokens|\bbatch[-_ ]size\b"
        r"|\bconcurren\w+|\bparallel\s+requests\b|\bmany\s+requests\b"
        r"|\bbeam\b|\bn\s*=\s*\d{2,})"
    ),
    "said_logprobs": (
        r"(?i:prompt[-_ ]logprobs|\ball\s+logits\b|\bfull[- ]vocab\w*"
        r"|\blogits\s+for\s+(?:all|every|the\s+whole))"
    ),
    "said_runtime": (
        r"(?i:\bshutting\s+down\b|\bshut\s+down\b"
        r"|\bduring\s+(?:inference|generation|serving|decoding)\b"
        r"|\bwhile\s+(?:serving|generating|running\s+requests)\b"
        r"|\bafter\s+(?:\d+\s+|a\s+few\s+|some\s+|several\s+)?"
        r"(?:hours?|minutes?|requests?|steps?)\b|\bat\s+runtime\b"
        r"|\bunder\s+load\b|\bat\s+step\s+\d+)"
    ),
    "said_startup": (
        r"(?i:\b(?:right\s+)?after\s+(?:the\s+)?(?:service|server|engine)\s+"
        r"(?:is\s+|was\s+)?start\w*|\b(?:at|during|on)\s+start-?up\b"
        r"|\bwhen\s+(?:starting|launching|loading)\b|\bwhile\s+loading\b"
        r"|\bengine\s+init\w*|\bimmediately\b)"
    ),
    "said_single_gpu": (
        r"(?i:\b(?:only|defaults?\s+to|just)\s+(?:uses?\s+)?(?:the\s+)?"
        r"(?:first|one|a\s+single|single)\s+GPU\b|\bsingle\s+GPU\b|\bone\s+GPU\b"
        # in Chinese: only one card used (只用了一张卡), the first card fills while the other
        # cards stay unchanged (第一张卡的显存增加…其他卡的显存不变)
        r"|只(?:用|使用|跑)了?(?:一张|第一张|单张?)(?:卡|GPU)"
        r"|其他(?:卡|GPU)[^。，,.]{0,8}?(?:不变|没有变化|没变|为0|空闲))"
    ),
}

# a utilization a text states: "gpu_memory_utilization default value to 1.0",
# "--gpu-memory-utilization=0.95"
SAID_UTIL = re.compile(
    r"(?i)gpu[-_ ]memory[-_ ]utili[sz]ation(?:\W+(?!0?\.\d|1\b|1\.0)\w+){0,5}?\W+"
    r"(?P<util>0?\.\d+|1\.0+|1)(?![\d.])"
)

# "The model is only 1.6G", "model size is 14GB": the writer's figure for the weights
SAID_MODEL_SIZE = re.compile(
    r"(?i)\b(?:model|weights)\s+"
    r"(?:is|are|size\s+is|weighs|takes?|took|taking|use[sd]?|need(?:s|ed)?"
    r"|occup(?:y|ies|ied)|consum(?:e|es|ed))\s+(?:only\s+|about\s+|around\s+|~\s?)?"
    # "13.4 GB", or a sum worked out per GPU: "13.37 * 2 = 27 GB" (the total is kept)
    r"(?:(?P<gib>\d+(?:\.\d+)?)\s?(?:G|GB|GiB)\b"
    r"|\d+(?:\.\d+)?\s?(?:G|GB|GiB)?\s?[*x×]\s?\d+\s?=\s?(?P<total>\d+(?:\.\d+)?)\s?(?:G|GB|GiB)\b)"
    # "25.42 GB of weights"
    r"|\b(?P<of>\d+(?:\.\d+)?)\s?(?:G|GB|GiB)\s+of\s+(?:model\s+)?weights\b"
)

# "~20 GiB reserved-but-unallocated", "reserved but unallocated: 402 MiB"
SAID_UNALLOCATED = re.compile(
    r"(?i)(?P<a>\d+(?:\.\d+)?)\s?(?P<a_unit>[KMGT]i?B)\s+(?:of\s+)?"
    r"(?:memory\s+)?reserved[- ]but[- ]unallocated"
    r"|reserved[- ]but[- ]unallocated(?:\s+memory)?\s*[:=]?\s*(?:of\s+|is\s+)?~?"
    r"(?P<b>\d+(?:\.\d+)?)\s?(?P<b_unit>[KMGT]i?B)"
)

# a GPU a text names: "8 A100-40Gs", "8xNVIDIA-H200", "A10*4", "RTX 4090 24GB", "dual-A100(40G)"
SAID_GPU = re.compile(
    r"(?:(?P<count>\d{1,2})\s?[x×*]?\s?|(?P<dual>dual|two|2)[- ])?(?:NVIDIA[- ]?)?"
    # (names in any case, "a100", "v100-16G"; not run into a following word but a plural s)
    r"(?P<name>(?i:A100|A800|H100|H800|H200|H20|B200|B100|GB200|L40S|L40|L4|L20|A10G|A10|A30|A40"
    r"|RTX\s?A6000|A6000|[RG]TX\s?\d{4}(?:\s?Ti)?|V100|T4|P100|MI\d{3}X?)(?![a-rt-zA-RT-Z]))"
    r"(?:[- ]?(?:SXM\d?|PCIe|NVL))?(?:\s?\(?[- ]?(?P<mem>\d{2,3})\s?(?:G|GB|GiB|g)s?\b\)?)?"
    r"(?:\s?[x×*]\s?(?P<count2>\d{1,2})\b)?"
)

# vLLM versions in a sentence about a regression ("works in 0.2.6 but OOMs in 0.2.7")
REGRESSION_WORDS = re.compile(
    r"(?i)\b(?:works?|worked|working|fine|ok|regression|previously|upgrad\w*|downgrad\w*)\b"
)
# (not inside a URL or a checkpoint name such as "Mixtral-8x7B-Instruct-v0.1-GPTQ")
VERSION = re.compile(
    r"(?i)(?<![\w./-])(?:v|vllm\s?|version\s)?(0\.\d{1,2}(?:\.\d{1,2})?)(?!\d|\.\d|[\w-])"
)

# vLLM releases that changed where memory goes; (version, cause, what changed). Sources: the
# v0.2.7 release notes (CUDA graphs captured by default, --enforce-eager added; vLLM PR
# #1926) and the v0.8.0 release notes (the V1 engine on by default, with torch.compile
# piecewise CUDA graphs over more batch sizes; docs/memory-model.md §2.6).
VERSION_BOUNDARIES: tuple[tuple[tuple[int, ...], str, str], ...] = (
    ((0, 2, 7), "cuda_graph", "vLLM 0.2.7 started capturing CUDA graphs by default"),
    (
        (0, 8, 0),
        "cuda_graph",
        "vLLM 0.8 made the V1 engine the default, which captures CUDA graphs for more batch sizes",
    ),
)


def version_tuple(text: str) -> tuple[int, ...]:
    """``"0.2.7"`` → ``(0, 2, 7)``; missing parts count as 0."""
    parts = [int(p) for p in text.split(".")[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def lever_cause(lever: str) -> str | None:
    """The cause a named lever addresses (``enforce-eager`` → ``cuda_graph``), or None."""
    for pattern, cause in LEVER_CAUSE:
        if pattern.search(lever):
            return cause
    return None
