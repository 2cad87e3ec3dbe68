"""The prompt set a head is trained on: diverse, reproducible, and not Spec-Bench.

A head learns to predict what the target says, so its training data is the target's own answers
to prompts like the ones it will serve: chat, writing, translation, summarising documents,
questions, math and code. Everything here is built from what any installation of the project has:
templates and topics written in this module, and documents and code taken from the Python standard
library (module, class and function docstrings; short functions' source). The same seed gives the
same prompts on every machine with the same Python version; prompts come out interleaved by kind,
so a generation run stopped early still covers every kind.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import random
import re
import textwrap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import zip_longest

KINDS = ("chat", "writing", "translation", "summarization", "qa", "rag", "math", "code")


@dataclass(frozen=True)
class Prompt:
    kind: str
    text: str

    @property
    def held_out(self) -> bool:
        """One prompt in twenty, by a hash of its text, is kept for held-out loss and acceptance."""
        return int(hashlib.sha1(self.text.encode()).hexdigest(), 16) % 20 == 0


STDLIB_MODULES = (
    "abc argparse ast asyncio base64 binascii bisect bz2 calendar cmath codecs collections colorsys "
    "concurrent.futures configparser contextlib copy csv dataclasses datetime decimal difflib dis doctest "
    "email enum fnmatch fractions ftplib functools gettext glob graphlib gzip hashlib heapq hmac html "
    "html.parser http.client imaplib inspect ipaddress itertools json locale logging lzma mailbox math "
    "multiprocessing operator optparse pathlib pickle platform pprint queue random re sched secrets "
    "selectors shutil signal smtplib socket sqlite3 statistics string struct subprocess sysconfig tarfile "
    "tempfile textwrap threading time timeit tomllib trace tracemalloc typing unicodedata unittest "
    "urllib.parse uuid wave weakref xml.etree.ElementTree zipfile zlib zoneinfo"
).split()

TOPICS = (
    "volcanoes", "honeybees", "the printing press", "black holes", "coral reefs", "the Roman aqueducts",
    "electric cars", "sourdough bread", "chess openings", "the water cycle", "jazz music", "glaciers",
    "the human immune system", "solar panels", "the Silk Road", "octopuses", "recycling plastics",
    "the French Revolution", "quantum computers", "desert ecosystems", "vaccines", "the Moon landing",
    "origami", "public libraries", "earthquakes", "the stock market", "tea ceremonies", "bicycles",
    "photosynthesis", "lighthouses", "the Amazon rainforest", "video game design", "ancient Egypt",
    "sleep", "the metric system", "wind turbines", "migratory birds", "the internet", "cheese making",
    "mountaineering", "the Olympic Games", "DNA", "urban gardening", "submarines", "renewable energy",
    "the history of money", "penguins", "climate change", "the violin", "space telescopes",
    "remote work", "meditation", "the Great Wall of China", "artificial intelligence", "rainbows",
    "marathon training", "museums", "the periodic table", "coffee", "trains", "dinosaurs",
)

CHAT = (
    "Hi! Can you tell me something interesting about {topic}?",
    "I'm bored. Suggest three fun activities related to {topic}.",
    "My friend says {topic} is overrated. How would you respond?",
    "Can you explain {topic} to a ten-year-old?",
    "What are the pros and cons of learning about {topic}?",
    "Give me some tips for a beginner interested in {topic}.",
    "I have an exam about {topic} tomorrow. What should I review?",
    "What is a common misconception about {topic}?",
    "Plan a weekend for someone who loves {topic}.",
    "Tell me a joke about {topic}, then explain why it is funny.",
    "You are a tour guide. Welcome a group of visitors interested in {topic}.",
    "Pretend you are a scientist from the year 2200. What do you think of {topic}?",
)

WRITING = (
    "Write a short poem about {topic}.",
    "Write a story of about 150 words in which {topic} plays a surprising role.",
    "Write a persuasive paragraph arguing that schools should teach more about {topic}.",
    "Write a product description for a board game about {topic}.",
    "Write a formal letter to a city council proposing a festival about {topic}.",
    "Draft an outline for an essay on {topic}.",
    "Write a dialogue between two friends who disagree about {topic}.",
    "Write a blog post introduction about {topic} with a catchy title.",
    "Write a haiku sequence of three haiku about {topic}.",
    "Write a news headline and a short article about a discovery related to {topic}.",
)

QA = (
    "What is {topic}?",
    "How does {topic} work?",
    "Why is {topic} important?",
    "When did people first learn about {topic}?",
    "Who are some famous people associated with {topic}?",
    "What are three facts about {topic} that most people do not know?",
    "How has {topic} changed over the last hundred years?",
    "What problems does {topic} face today?",
)

GERMAN = (  # everyday sentences, then news of the kind German-English translation is asked for most
    "Der Zug nach Berlin hat heute zwanzig Minuten Verspätung.",
    "Meine Großmutter backt jeden Sonntag einen Apfelkuchen.",
    "Die Stadt plant, im nächsten Jahr neue Radwege zu bauen.",
    "Wir haben im Urlaub viele alte Kirchen besichtigt.",
    "Der Bericht zeigt, dass die Preise für Lebensmittel gestiegen sind.",
    "Kannst du mir bitte sagen, wo der nächste Bahnhof ist?",
    "Die Forscher haben eine neue Art von Frosch im Regenwald entdeckt.",
    "Am Wochenende soll es in ganz Deutschland regnen.",
    "Das Museum ist montags geschlossen, aber dienstags ist der Eintritt frei.",
    "Die Regierung will mehr Geld in Schulen und Universitäten investieren.",
    "Ich lerne seit zwei Jahren Spanisch, weil ich in Madrid arbeiten möchte.",
    "Der Trainer war mit der Leistung seiner Mannschaft sehr zufrieden.",
    "Viele Menschen arbeiten inzwischen von zu Hause aus.",
    "Die Brücke wird wegen Bauarbeiten drei Wochen lang gesperrt.",
    "Das neue Gesetz tritt am ersten Januar in Kraft.",
    "Nach dem Konzert gingen wir noch in ein kleines Restaurant.",
    "Die Firma hat im letzten Quartal deutlich mehr Autos verkauft.",
    "Im Winter füttern wir die Vögel in unserem Garten.",
    "Der Arzt empfiehlt, jeden Tag mindestens dreißig Minuten spazieren zu gehen.",
    "Die Ausstellung zeigt Gemälde aus dem neunzehnten Jahrhundert.",
    "Es ist wichtig, genug Wasser zu trinken, besonders im Sommer.",
    "Die Polizei sucht nach Zeugen des Unfalls auf der Autobahn.",
    "Unsere Nachbarn haben einen kleinen Hund namens Max.",
    "Die Bibliothek bietet jetzt auch Kurse für ältere Menschen an.",
    "Der Flughafen erwartet in diesem Sommer so viele Reisende wie nie zuvor.",
    "Die Schüler haben ein Theaterstück über die Geschichte ihrer Stadt geschrieben.",
    "Wegen des Streiks fahren heute keine Busse.",
    "Die Wissenschaftler warnen vor den Folgen des Klimawandels für die Alpen.",
    "Ich habe das Buch in einer Nacht gelesen, so spannend war es.",
    "Der Bürgermeister eröffnete den neuen Spielplatz im Park.",
    "Die Bundesregierung hat am Mittwoch ein neues Paket zur Entlastung von Familien mit niedrigem Einkommen beschlossen.",
    "Nach Angaben der Polizei wurden bei dem Zusammenstoß zweier Lastwagen auf der A7 drei Menschen leicht verletzt.",
    "Der Vorstandsvorsitzende kündigte an, dass das Unternehmen bis Ende des Jahres rund 2000 Stellen abbauen wird.",
    "Die Verhandlungen zwischen der Gewerkschaft und den Arbeitgebern wurden in der Nacht ohne Ergebnis abgebrochen.",
    "Experten gehen davon aus, dass die Inflation im kommenden Jahr langsam zurückgehen wird.",
    "Der Stadtrat stimmte mit knapper Mehrheit für den Bau eines neuen Hallenbads im Norden der Stadt.",
    "In der zweiten Halbzeit gelang dem Gastgeber nach einem Eckball der verdiente Ausgleichstreffer.",
    "Die Ausstellung, die bereits mehr als 100.000 Besucher anzog, wird bis Ende März verlängert.",
    "Wissenschaftler der Universität Heidelberg haben ein Verfahren entwickelt, mit dem sich Krebszellen früher erkennen lassen.",
    "Der Präsident betonte in seiner Rede, dass die Zusammenarbeit mit den europäischen Partnern weiter gestärkt werden müsse.",
    "Wegen eines Stromausfalls standen am Montagmorgen in weiten Teilen der Innenstadt die Ampeln still.",
    "Die Opposition wirft der Regierung vor, die Probleme im Gesundheitswesen seit Jahren zu ignorieren.",
    "Laut einer aktuellen Umfrage würden 38 Prozent der Befragten die Partei wählen, wenn am Sonntag Bundestagswahl wäre.",
    "Der Angeklagte bestritt vor Gericht, etwas mit dem Diebstahl der Gemälde zu tun zu haben.",
    "Nach monatelangen Bauarbeiten ist die Brücke über den Rhein wieder für den Verkehr freigegeben.",
    "Die Zentralbank hat den Leitzins erneut um einen Viertelprozentpunkt angehoben.",
    "Der Sänger sagte sein Konzert in Hamburg kurzfristig ab, weil er an einer Erkältung leidet.",
    "Immer mehr junge Menschen ziehen aus den Großstädten aufs Land, weil die Mieten dort günstiger sind.",
    "Die Feuerwehr konnte den Brand in der Lagerhalle nach mehreren Stunden unter Kontrolle bringen.",
    "Der Außenminister reiste am Dienstag zu Gesprächen über die Lage im Nahen Osten nach Kairo.",
    "Die Zahl der Arbeitslosen ist im Oktober saisonbedingt leicht gesunken.",
    "Bei der Wahl des neuen Bürgermeisters lag die Wahlbeteiligung bei nur 42 Prozent.",
    "Die Fluggesellschaft streicht wegen des Streiks des Kabinenpersonals mehr als hundert Flüge.",
    "Das Gericht entschied, dass der Konzern den Kunden einen Teil der Gebühren zurückzahlen muss.",
    "Die Forscher untersuchten über einen Zeitraum von zehn Jahren die Gesundheit von mehr als 5000 Erwachsenen.",
    "Der Trainer wollte sich nach dem Spiel nicht zu den Gerüchten über seine Zukunft äußern.",
    "Viele Landwirte klagen über die anhaltende Trockenheit, die in diesem Sommer große Teile der Ernte vernichtet hat.",
    "Die Stadt will bis zum Jahr 2030 klimaneutral werden und investiert deshalb massiv in den Nahverkehr.",
    "Der Verdächtige wurde nach einer Verfolgungsjagd in der Nähe des Hauptbahnhofs festgenommen.",
    "In dem Bericht heißt es, dass die Zahl der Cyberangriffe auf Behörden deutlich zugenommen hat.",
    "Die Schauspielerin erhielt für ihre Rolle in dem Drama den wichtigsten Preis des Festivals.",
    "Das Ministerium kündigte an, die Förderung für Elektroautos Ende des Jahres auslaufen zu lassen.",
    "Zehntausende Menschen demonstrierten am Samstag in der Hauptstadt für mehr Klimaschutz.",
    "Der Autohersteller rechnet wegen der hohen Energiekosten mit einem Rückgang des Gewinns.",
    "Nach dem Erdbeben sind Hilfsorganisationen mit Zelten, Decken und Lebensmitteln in die Region unterwegs.",
    "Die Mannschaft steht nach dem Sieg gegen den Tabellenführer erstmals seit zwanzig Jahren im Halbfinale.",
    "Die Schulen sollen in den nächsten fünf Jahren mit schnellem Internet und neuen Computern ausgestattet werden.",
    "Er habe nie die Absicht gehabt, die Öffentlichkeit zu täuschen, sagte der Minister bei einer Pressekonferenz.",
    "Die Preise für Wohnungen in München sind im vergangenen Jahr um fast zehn Prozent gestiegen.",
    "Der Bahnverkehr zwischen Köln und Frankfurt war am Freitag wegen eines Oberleitungsschadens stundenlang unterbrochen.",
    "Die Europäische Union will die Einfuhr von Produkten verbieten, für deren Herstellung Wälder gerodet wurden.",
    "Das Krankenhaus sucht dringend Pflegekräfte, weil viele Stellen seit Monaten unbesetzt sind.",
    "Der Film erzählt die Geschichte einer Familie, die nach dem Krieg einen Neuanfang wagt.",
    "Die Ermittler gehen davon aus, dass das Feuer vorsätzlich gelegt wurde.",
    "Bei dem Unwetter stürzten zahlreiche Bäume um, mehrere Straßen mussten gesperrt werden.",
    "Der Konzern will in den nächsten drei Jahren rund fünf Milliarden Euro in neue Fabriken investieren.",
    "Die Abgeordneten debattierten stundenlang über den Haushalt für das kommende Jahr.",
    "Der Schriftsteller, der vor allem durch seine Kriminalromane bekannt wurde, ist im Alter von 81 Jahren gestorben.",
    "Nach Ansicht von Fachleuten reichen die bisherigen Maßnahmen nicht aus, um die Klimaziele zu erreichen.",
    "Die Polizei bittet die Bevölkerung um Hinweise zu dem Überfall auf die Tankstelle.",
    "Der Verein trennt sich nach nur vier Monaten von seinem Trainer.",
    "Die Verbraucherzentrale warnt vor betrügerischen Nachrichten, die angeblich von Banken stammen.",
    "Nach Angaben des Statistischen Bundesamtes wurden im vergangenen Jahr weniger Kinder geboren als im Jahr zuvor.",
    "Das Museum zeigt erstmals Zeichnungen des Künstlers, die lange als verschollen galten.",
    "Der Gipfel endete mit einer gemeinsamen Erklärung, in der sich alle Staaten zu mehr Zusammenarbeit verpflichten.",
    "Die Bauarbeiten am neuen Flughafen haben sich um weitere zwei Jahre verzögert.",
    "Die Zahl der Touristen in der Region hat wieder das Niveau von vor der Pandemie erreicht.",
    "Der Bundestag hat das Gesetz mit den Stimmen der Regierungsparteien verabschiedet.",
    "Die Ärzte raten älteren Menschen, sich im Herbst gegen Grippe impfen zu lassen.",
    "In der Nacht zum Sonntag brachen Unbekannte in eine Schule ein und stahlen mehrere Laptops.",
    "Der Tennisspieler musste das Turnier wegen einer Verletzung am Handgelenk vorzeitig beenden.",
    "Die Regierung plant, das Rentenalter schrittweise auf 67 Jahre anzuheben.",
    "Die Studie zeigt, dass Kinder, die regelmäßig vorgelesen bekommen, später besser lesen können.",
    "Nach heftigen Regenfällen sind mehrere Flüsse über die Ufer getreten.",
    "Das Unternehmen bestätigte, dass bei dem Hackerangriff Daten von Millionen Kunden gestohlen wurden.",
    "Der Oberbürgermeister lud die Bürger zu einer Diskussion über die Zukunft der Innenstadt ein.",
    "Die Sanierung des historischen Rathauses soll rund zwölf Millionen Euro kosten.",
    "Die Gewerkschaft fordert eine Lohnerhöhung von acht Prozent und eine kürzere Arbeitszeit.",
    "Das Orchester spielte zum Abschluss der Saison Werke von Beethoven und Brahms.",
    "Die Staatsanwaltschaft hat gegen den ehemaligen Manager Anklage wegen Betrugs erhoben.",
    "Nach dem Unfall bildete sich auf der Autobahn ein kilometerlanger Stau.",
    "Der Wetterdienst warnt für das Wochenende vor Sturmböen und starkem Schneefall in den Bergen.",
    "Die Partei wählte auf ihrem Parteitag eine neue Vorsitzende.",
    "Viele Geschäfte in der Fußgängerzone stehen leer, weil der Onlinehandel immer wichtiger wird.",
    "Die Astronauten kehrten nach sechs Monaten auf der Internationalen Raumstation zur Erde zurück.",
    "Der Bürgerentscheid über die Straßenbahn wurde mit deutlicher Mehrheit angenommen.",
    "Die Kosten für Strom und Gas haben viele Haushalte im vergangenen Winter stark belastet.",
    "Der Zoo freut sich über die Geburt von zwei kleinen Eisbären.",
    "Die Behörden haben die Bewohner aufgefordert, Fenster und Türen geschlossen zu halten.",
    "Der Weltmeister gewann das Rennen mit einem Vorsprung von fast zehn Sekunden.",
    "Die Universität bietet ab dem Wintersemester einen neuen Studiengang für künstliche Intelligenz an.",
    "Die Verhandlungen über ein Freihandelsabkommen ziehen sich bereits seit mehr als zehn Jahren hin.",
    "Das Dorf feiert in diesem Jahr sein 800-jähriges Bestehen mit einem großen Fest.",
    "Der Minister räumte ein, dass bei der Planung des Projekts Fehler gemacht worden seien.",
    "Die Zahl der Verkehrstoten ist im ersten Halbjahr auf einen neuen Tiefstand gesunken.",
    "Die neue Regelung soll verhindern, dass Mieter ihre Wohnung wegen hoher Nebenkosten verlieren.",
    "Der Regisseur arbeitet bereits an der Fortsetzung seines erfolgreichen Films.",
    "Im Süden des Landes wurden Temperaturen von mehr als 40 Grad gemessen.",
    "Die Kommission empfiehlt, die Zahl der Krankenhäuser zu verringern und die übrigen besser auszustatten.",
    "Der Fußballverband hat die Sperre gegen den Spieler auf drei Spiele verkürzt.",
    "Die Stadtwerke erhöhen zum ersten Januar die Preise für Fernwärme.",
    "Nach dem Ende der Sommerferien beginnt für rund 100.000 Kinder die Schule.",
    "Die Bank meldete für das dritte Quartal einen Rekordgewinn.",
    "Der Vulkan auf der Insel ist erneut ausgebrochen, der Flughafen bleibt vorerst geschlossen.",
    "Die Kanzlerin traf sich am Rande des Gipfels zu einem Gespräch mit dem amerikanischen Präsidenten.",
    "Viele Eltern finden für ihre Kinder keinen Platz in einer Kita.",
    "Der Musiker veröffentlicht nach acht Jahren Pause ein neues Album.",
    "Die Feuerwehr rettete eine Katze, die sich auf einem Baum verirrt hatte.",
    "Die Ermittlungen gegen den Politiker wurden aus Mangel an Beweisen eingestellt.",
    "Der Hafen von Hamburg hat im vergangenen Jahr weniger Container umgeschlagen als erwartet.",
    "Die Polizei kontrollierte am Wochenende mehr als 500 Fahrzeuge und stellte zahlreiche Verstöße fest.",
)
TRANSLATION_TARGETS = ("French", "German", "Spanish", "Italian")

MATH_TEMPLATES = (
    "{a} students are in a class. Each student needs {b} pencils, and pencils come in boxes of {c}. "
    "How many boxes does the teacher need to buy?",
    "A shop sells apples for {b} cents each. Maria buys {a} apples and pays with a {d}-dollar bill. "
    "How much change does she get?",
    "A train travels at {a} kilometers per hour for {b} hours and then at {c} kilometers per hour for "
    "{d} hours. How far does it travel in total?",
    "Tom saves {b} dollars every week. He wants to buy a bike that costs {a} dollars more than {c} "
    "dollars. How many weeks does he need to save?",
    "A garden is {a} meters long and {b} meters wide. A path of {c} meter goes around it. What is the "
    "area of the path?",
    "Sam had {a} marbles. He gave {b} to his sister and then bought {c} more packs of {d} marbles each. "
    "How many marbles does he have now?",
    "What is {a} multiplied by {b}, minus {c}?",
    "Solve for x: {b}x + {c} = {a}.",
    "A recipe needs {b} eggs for {c} people. How many eggs are needed for {a} people?",
    "The price of a jacket is {a} dollars. It is on sale for {b} percent off. What is the sale price?",
)

CODE_TASKS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number using iteration.",
    "Write a function in Python that merges two sorted lists into one sorted list.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a Python script that counts the words in a text file.",
    "Write a function that removes duplicates from a list while keeping the order.",
    "Write a SQL query that finds the ten customers with the highest total order value.",
    "Write a JavaScript function that reverses the words in a sentence.",
    "Write a Python function that converts a temperature from Celsius to Fahrenheit.",
    "Write a binary search function in Python and explain its time complexity.",
    "Write a Python generator that yields the prime numbers below a limit.",
    "Write a function that flattens a nested list in Python.",
    "Write a C function that computes the length of a string without using strlen.",
    "Write a Python function that validates an email address with a regular expression.",
)
CODE_ABOUT = (
    "Explain what this Python function does:\n\n{code}",
    "Suggest improvements to the following code:\n\n{code}",
    "Write a docstring for this function:\n\n{code}",
    "What could go wrong with this code? \n\n{code}",
)


def _documents() -> list[str]:
    """Docstrings of the standard library worth summarizing: 300 to 2,500 characters of prose."""
    with warnings.catch_warnings():  # reading the docs of deprecated aliases (typing.io) warns
        warnings.simplefilter("ignore", DeprecationWarning)
        return _docstrings()


def _docstrings() -> list[str]:
    docs = []
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        members = [module] + [obj for _, obj in sorted(vars(module).items())
                              if (inspect.isclass(obj) or inspect.isfunction(obj))
                              and getattr(obj, "__module__", None) == module.__name__]
        for obj in members:
            doc = inspect.getdoc(obj) or ""
            if 300 <= len(doc) <= 2500 and doc.count(">>>") < 3:
                docs.append(doc)
    return list(dict.fromkeys(docs))


def _code_snippets() -> list[str]:
    """Source of short pure-Python standard library functions (6 to 30 lines)."""
    snippets = []
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for _, obj in sorted(vars(module).items()):
            if not inspect.isfunction(obj) or obj.__module__ != module.__name__:
                continue
            try:
                source = textwrap.dedent(inspect.getsource(obj))
            except (OSError, TypeError):
                continue
            if 6 <= source.count("\n") <= 30:
                snippets.append(source)
    return snippets


def _sentences(documents: list[str]) -> list[str]:
    found = []
    for doc in documents:
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
            if 60 <= len(sentence) <= 200 and sentence[0].isupper() and "`" not in sentence:
                found.append(sentence)
    return list(dict.fromkeys(found))


def _math(rng: random.Random) -> str:
    template = rng.choice(MATH_TEMPLATES)
    return template.format(a=rng.randint(12, 480), b=rng.randint(2, 15), c=rng.randint(2, 9), d=rng.randint(2, 20))


def _by_kind(rng: random.Random, per_kind: int) -> dict[str, list[str]]:
    documents, code, = _documents(), _code_snippets()
    sentences = _sentences(documents)
    rng.shuffle(documents)
    rng.shuffle(code)

    def templated(templates: tuple[str, ...]) -> list[str]:
        pairs = [t.format(topic=topic) for t in templates for topic in TOPICS]
        rng.shuffle(pairs)
        return pairs[:per_kind]

    german = [f"Translate German to English: {s}" for s in GERMAN]
    german += [f"Translate German to English: {a} {b}" for a, b in zip(GERMAN[::2], GERMAN[1::2])]
    others = [f"Translate into {rng.choice(TRANSLATION_TARGETS)}: {s}" for s in sentences]
    translation = rng.sample(german, min(len(german), 2 * per_kind // 3))  # German into English first: most asked
    translation += rng.sample(others, min(len(others), per_kind - len(translation)))
    rng.shuffle(translation)
    summarize = ("Summarize: {doc}", "Summarize the following text in three sentences.\n\n{doc}",
                 "Write a one-paragraph summary of this documentation:\n\n{doc}")
    rag = ("{doc}\n\nBased on the text above, what is its main purpose?",
           "{doc}\n\nAccording to this text, what should a user be careful about?",
           "{doc}\n\nList the key terms defined in the text above.")
    return {
        "chat": templated(CHAT),
        "writing": templated(WRITING),
        "qa": templated(QA),
        "translation": translation,
        "summarization": [rng.choice(summarize).format(doc=d) for d in documents[:per_kind]],
        "rag": [rng.choice(rag).format(doc=d) for d in documents[per_kind:2 * per_kind]],
        "math": list(dict.fromkeys(_math(rng) for _ in range(per_kind))),
        "code": rng.sample(CODE_TASKS, len(CODE_TASKS))
        + [rng.choice(CODE_ABOUT).format(code=c) for c in code[: per_kind - len(CODE_TASKS)]],
    }


def build_prompts(count: int = 1200, seed: int = 0) -> list[Prompt]:
    """`count` prompts (fewer if a kind runs out), interleaved by kind."""
    rng = random.Random(seed)
    by_kind = _by_kind(rng, -(-count // len(KINDS)))
    rounds: Iterator = zip_longest(*(by_kind[kind] for kind in KINDS))
    prompts = [Prompt(kind, text) for row in rounds for kind, text in zip(KINDS, row) if text is not None]
    return prompts[:count]
