#!/usr/bin/perl

# Metrics in the Prometheus text format (llama_session_metrics) and what
# the replies say of the cache, with the fake backend: the exposition is
# valid (every family typed once, its samples together, histograms
# cumulative with +Inf = count, no session id anywhere), the counters
# follow what happened (requests by outcome, saves by reason, restores
# effective or not, bytes, tokens from the cache), the figures are read
# from JSON replies and from the last events of a stream, and restores
# that bring nothing stop saves and restores after three in a row.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
$t->fake(np => 1);

$t->nginx($t->site(
    zone => q{
        llama_session_zone zone=llama:1m store=%%SLOTS%%;
        llama_session_zone zone=other:1m;
    },
    http => q{
        log_format cache '$llama_session_id $llama_session_action '
                         'cached=$llama_session_cached_tokens';
    },
    location => q{
        access_log %%DIR%%/cache.log cache;
        add_header X-S-Action $llama_session_action always;
    },
    extra => q{
        location = /metrics { llama_session_metrics; }
        location = /metrics/llama { llama_session_metrics llama; }
        location /api/ { llama_session_api llama; }
    }));

my %conv;

sub turn {
    my ($sid, %o) = @_;
    $conv{$sid} //= [ { role => 'user', content => join ' ', map {
                          "Session $sid keeps note $_." } 1 .. 20 } ];
    my $r = $t->post('/v1/chat/completions',
                     { messages => $conv{$sid}, max_tokens => 4,
                       ($o{stream} ? (stream => \1) : ()) },
                     headers => { 'X-Session-Id' => $sid });
    die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    push @{ $conv{$sid} }, { role => 'assistant', content => 'ok' },
                           { role => 'user', content => "More, $sid." };
    return $r;
}

# parses and checks an exposition; returns { 'name{labels}' => value }
sub scrape {
    my ($path) = @_;
    my $r = $t->get($path // '/metrics');
    is($r->{status}, 200, 'metrics: 200');
    like($r->{headers}{'content-type'}, qr{^text/plain; version=0\.0\.4},
         'in the text format');

    my (%type, %seen, %v, $family, @errors);
    for my $line (split /\n/, $r->{content}) {
        if ($line =~ /^# HELP (\w+) \S/) { next }
        if ($line =~ /^# TYPE (\w+) (counter|gauge|histogram)$/) {
            push @errors, "second TYPE for $1" if $type{$1};
            $type{$1} = $2;
            $family = $1;
            next;
        }
        my ($name, $labels, $value) =
            $line =~ /^([a-z_]+)\{((?:[a-z_]+="[^"\\]*",?)*)\} (\S+)$/
            or do { push @errors, "bad line: $line"; next };
        push @errors, "not a number: $line" unless $value =~ /^[0-9.e+-]+$/;
        my $base = $name;
        $base =~ s/_(bucket|sum|count)$//
            if $family && $type{$family} eq 'histogram';
        push @errors, "$name outside its family $family"
            unless $base eq $family;
        push @errors, "a colon in $name" if $name =~ /:/;
        push @errors, "a session id in $line" if $line =~ /session="|sid|X-Session/i;
        push @errors, "twice: $name\{$labels}" if $seen{"$name\{$labels}"}++;
        $v{"$name\{$labels}"} = $value;
    }

    # histograms: cumulative buckets, +Inf = count
    for my $h (grep { $type{$_} eq 'histogram' } keys %type) {
        my %by;
        for my $k (grep { /^${h}_bucket\{/ } keys %v) {
            my ($rest) = $k =~ /^${h}_bucket\{(.*),le="[^"]+"\}$/;
            my ($le) = $k =~ /le="([^"]+)"/;
            push @{ $by{$rest} }, [ $le eq '+Inf' ? 9e99 : $le, $v{$k} ];
        }
        for my $rest (keys %by) {
            my @b = sort { $a->[0] <=> $b->[0] } @{ $by{$rest} };
            for my $i (1 .. $#b) {
                push @errors, "$h buckets not cumulative"
                    if $b[$i][1] < $b[$i - 1][1];
            }
            push @errors, "$h +Inf != count"
                unless $b[-1][1] == $v{"${h}_count\{$rest}"};
        }
    }

    is_deeply(\@errors, [], 'the exposition is valid') or diag $r->{content};
    return \%v;
}

sub metric { my ($v, $k) = @_; return $v->{"nginx_llama_session_$k"} // 'none' }

# a, b, a: two swaps that save, one restore the reply shows used

turn('a');
turn('b');
my $r = turn('a');
is($r->{headers}{'x-s-action'}, 'restore', 'a is restored');
my $cached = $r->{json}{timings}{cache_n};
ok($cached > 100, "the reply shows $cached cached");

my $v = scrape();
is(metric($v, 'requests_total{zone="llama",outcome="restore"}'), 1,
   'requests_total: 1 restore');
is(metric($v, 'requests_total{zone="llama",outcome="fresh"}'), 2, '2 fresh');
is(metric($v, 'saves_total{zone="llama",reason="swap",result="ok"}'), 2,
   'saves_total by reason and result: 2 swap saves');
is(metric($v, 'saves_total{zone="llama",reason="idle",result="ok"}'), 0,
   'no idle save');
is(metric($v, 'restores_total{zone="llama",result="ok"}'), 1, '1 restore ok');
is(metric($v, 'restore_effects_total{zone="llama",effect="effective"}'), 1,
   'and effective, as its reply showed');
is(metric($v, 'restore_effects_total{zone="llama",effect="ineffective"}'), 0,
   'none ineffective');
my $restores = 0;
$restores += $v->{$_} for grep { /^nginx_llama_session_restores_total\{zone="llama",/ } keys %$v;
is($restores, 1, 'a sum over restores_total counts the restore once');
ok(metric($v, 'saved_bytes_total{zone="llama"}') > 0, 'bytes saved');
ok(metric($v, 'restored_bytes_total{zone="llama"}') > 0, 'bytes restored');
is(metric($v, 'swap_seconds_count{zone="llama"}'), 3,
   'swap_seconds counts the 3 swaps');
is(metric($v, 'restore_seconds_count{zone="llama"}'), 1, 'restore_seconds: 1');
is(metric($v, 'save_seconds_count{zone="llama"}'), 2, 'save_seconds: 2');
is(metric($v, 'wait_seconds_count{zone="llama"}'), 3, 'wait_seconds: 3');
is(metric($v, 'prompt_tokens_total{zone="llama",source="cache"}'), $cached,
   'prompt_tokens_total from the cache: the reply\'s');
ok(metric($v, 'prompt_tokens_total{zone="llama",source="evaluated"}') > 0,
   'and evaluated');
ok(metric($v, 'prefill_saved_seconds_total{zone="llama"}') > 0,
   'prefill time saved, estimated');
is(metric($v, 'slots{zone="llama"}'), 1, 'slots: 1');
is(metric($v, 'slots_busy{zone="llama"}'), 0, 'none busy');
is(metric($v, 'slot_busy{zone="llama",slot="0"}'), 0, 'slot 0 is not busy');
is(metric($v, 'store_files{zone="llama"}'), 2, 'store_files: 2');
is(metric($v, 'restores_disabled{zone="llama"}'), 0, 'restores are on');
ok(exists $v->{'nginx_llama_session_requests_total{zone="other",outcome="hit"}'},
   'every zone by default');

my $one = scrape('/metrics/llama');
ok(!grep({ /zone="other"/ } keys %$one), 'or the zones named');

# the figures of a stream's last event

turn('b');
$r = turn('a', stream => 1);
like($r->{content}, qr/"cache_n":\d+/, 'a streamed reply with timings');
$v = scrape();
is(metric($v, 'restore_effects_total{zone="llama",effect="effective"}'), 3,
   'b\'s restore and a\'s streamed one count as effective too');

ok($t->wait_for(sub { ($t->read_file('cache.log') // '') =~ /^a restore cached=[1-9]\d*$/m }, 5),
   '$llama_session_cached_tokens in the access log');
like($t->read_file('cache.log'), qr/^a fresh cached=0$/m,
   'a fresh request shows 0');

# restores that bring nothing: three in a row stop saves and restores, of
# those that prove it (a file re-primed before its save, the prompt's
# earlier messages unchanged): a's first file here was saved as the slot
# held it (its streamed reply had no end the turn could keep), its miss
# proves nothing and is counted, not as one of the three

ok(!$t->get('/api/sessions/current')->{json}{restores_disabled},
   'the API shows restores on');

$t->fake_script({ restore => { discard => 1 } });
for my $sid (qw(b a b a)) {
    $r = turn($sid);
    is($r->{headers}{'x-s-action'}, 'restore', "$sid: a discarded restore answered 200");
    is($r->{json}{timings}{cache_n}, 0, 'and the reply shows nothing cached');
}
ok($t->log_lines(qr/3 restores in a row in zone "llama" brought nothing .* stops saving and restoring/),
   'the error log says the zone stops saving and restoring');
$v = scrape();
is(metric($v, 'restore_effects_total{zone="llama",effect="ineffective"}'), 4,
   'the ineffective restores counted');
is(metric($v, 'restores_disabled{zone="llama"}'), 1, 'restores_disabled: 1');

my $calls = @{ $t->fake_calls };
$r = turn('b');
is($r->{headers}{'x-s-action'}, 'fresh', 'then b starts fresh');
turn('a');
ok(!grep({ ($_->{query} // '') =~ /action=(save|restore)/ }
          @{ $t->fake_calls }[$calls .. $#{ $t->fake_calls }]),
   'and no save: nothing is paid for there');
ok($t->get('/api/sessions/current')->{json}{restores_disabled},
   'the API says so');

# the example Grafana dashboard asks only for names the module has

my $dash = $LlamaTest::JSON->decode(do { local $/; open my $fh, "<", "$FindBin::Bin/../examples/grafana-dashboard.json" or die; <$fh> });
my %have = map { /^(nginx_llama_session_\w+?)(_bucket)?\{/ ? ($1 => 1) : () } keys %$v;
my @asked = map { $_->{expr} =~ /(nginx_llama_session_\w+)/g }
            map { @{ $_->{targets} } } @{ $dash->{panels} };
ok(@asked > 20, scalar(@asked) . ' names in the dashboard\'s queries');
my @missing = grep { (my $n = $_) =~ s/_bucket$//; !$have{$n} } @asked;
is_deeply(\@missing, [], 'each of them is in the exposition');

# only GET and HEAD

is($t->request('POST', '/metrics')->{status}, 405, 'POST /metrics: 405');

$t->stop;
done_testing;
